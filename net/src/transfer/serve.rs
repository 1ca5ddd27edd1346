//! The holder's side of the transfer protocol: answers each request on a connection with
//! a shared-memory handle to a same-host caller, or the object streamed in checked chunks.

use std::io;
use std::sync::Arc;

use bytes::Bytes;

use super::{
    timed, ObjectSource, CHUNK_BYTES, REQUEST_LEN, SHARED_ANSWER_TIMEOUT, STATUS_MISSING, STATUS_SHARED, STATUS_STREAM,
    WANTS_SHARED,
};
use crate::sealed::SealedStream;
use regatta_object_store::HostKey;
use regatta_object_store::ObjectId;

/// Answers requests on one connection until the peer closes it.
pub(super) async fn serve_connection(
    mut stream: SealedStream,
    source: Arc<dyn ObjectSource>,
    corrupt: bool,
    host: Option<HostKey>,
) -> io::Result<()> {
    // Waiting for the next request has no deadline: the caller keeps idle connections.
    while let Some((_, request)) = stream.receive_message_or_end().await? {
        let request = <[u8; REQUEST_LEN]>::try_from(&request[..]).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a request of {} bytes, {REQUEST_LEN} expected", request.len()),
            )
        })?;
        serve_one(&mut stream, &request, &source, corrupt, host).await?;
    }
    Ok(())
}

async fn serve_one(
    stream: &mut SealedStream,
    request: &[u8; REQUEST_LEN],
    source: &Arc<dyn ObjectSource>,
    corrupt: bool,
    host: Option<HostKey>,
) -> io::Result<()> {
    let mut raw = [0u8; 16];
    raw.copy_from_slice(&request[..16]);
    let id = ObjectId::from_bytes(raw);
    let mut key = [0u8; HostKey::LEN];
    key.copy_from_slice(&request[17..]);
    let same_host = request[16] & WANTS_SHARED != 0 && host == Some(HostKey::from_bytes(&key));
    if same_host {
        let shared = {
            let source = source.clone();
            tokio::task::spawn_blocking(move || source.share(id))
                .await
                .map_err(io::Error::other)?
        };
        if let Some(segment) = shared {
            let mut reply = vec![STATUS_SHARED];
            reply.extend_from_slice(&segment.handle().to_bytes());
            timed(stream.send(0, &reply)).await?;
            // The caller answers once it has mapped the segment (populating a large one takes
            // a while); a caller that never answers does not hold this task for ever.
            let answer = match tokio::time::timeout(SHARED_ANSWER_TIMEOUT, stream.receive_message()).await {
                Ok(read) => read?.1,
                Err(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no answer to a shared-memory handle",
                    ))
                }
            };
            if answer == [1] {
                source.sent(segment.len());
                return Ok(());
            }
            // The caller could not map it (another user, say): stream it after all.
        }
    }
    let Some(bytes) = source.open(id) else {
        return timed(stream.send(0, &[STATUS_MISSING])).await;
    };
    let outcome = stream_object(stream, &bytes, corrupt).await;
    source.release(id);
    if outcome.is_ok() {
        source.sent(bytes.len() as u64);
    }
    outcome
}

async fn stream_object(stream: &mut SealedStream, bytes: &Bytes, corrupt: bool) -> io::Result<()> {
    let mut header = vec![STATUS_STREAM];
    header.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    timed(stream.send(0, &header)).await?;
    let mut offset = 0;
    while offset < bytes.len() {
        let end = (offset + CHUNK_BYTES).min(bytes.len());
        let mut chunk = bytes.slice(offset..end);
        if corrupt && offset == 0 {
            let mut damaged = chunk.to_vec();
            damaged[0] ^= 0xff;
            chunk = Bytes::from(damaged);
        }
        // Word 0: a header travels in clear, and a chunk's CRC would give its bytes away.
        timed(stream.send(0, &chunk)).await?;
        offset = end;
    }
    // Keep the object pinned until the caller has every byte.
    timed(stream.receive_message()).await?;
    Ok(())
}
