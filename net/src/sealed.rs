//! Sealed frames: how the object transfer's connections, and the training ring's between
//! hosts, carry their bytes once TLS 1.3 has authenticated both ends.
//!
//! The TLS handshake (mutual, from the cluster token) proves who is at each end and agrees
//! a secret; both ends then export 64 bytes from it (RFC 8446 §7.5, the exporter
//! [`EXPORTER_LABEL`]): a secret for each direction, from which HMAC-SHA256 derives that
//! direction's AES-128-GCM key and IV, and a new pair every [`FRAMES_PER_KEY`] frames (so a
//! ring link that lives for a whole training never takes one key past AES-GCM's safe
//! volume, as TLS 1.3's key update does). From then on every message and every object
//! chunk is one frame:
//!
//! `[payload length u32 LE][word u32 LE][ciphertext][16-byte tag]`
//!
//! with the 8-byte header as associated data and the nonce made as TLS 1.3 makes its
//! records' (the IV XOR the frame's sequence number in its direction). A changed, dropped,
//! replayed or reordered frame fails to open, as a TLS record would. What TLS's own record
//! layer costs and this does not: records of at most 16 KiB, each copied out of rustls's
//! buffers on both sides. Here a chunk of up to [`crate::transfer::CHUNK_BYTES`] is sealed
//! straight from the object into the send buffer, and received straight into the object's
//! buffer, where it is opened in place.
//!
//! The keys and the sealing are pure ([`Keys`]); [`SealedStream`] only moves frames over a
//! TCP stream.

use std::io;

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM, NONCE_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The label both ends export their frame keys under.
pub const EXPORTER_LABEL: &[u8] = b"EXPORTER-regatta-object-frames-v1";

/// Bytes of a frame's header (payload length, word).
pub const HEADER_LEN: usize = 8;

/// Bytes of a frame's authentication tag.
pub const TAG_LEN: usize = 16;

/// Largest payload of a message (a request, a status, a shared-memory handle).
const MAX_MESSAGE: usize = 256;

const KEY_LEN: usize = 16;

const SECRET_LEN: usize = 32;

/// Bytes exported from the TLS session: a secret per direction.
pub const EXPORTED_LEN: usize = 2 * SECRET_LEN;

/// Frames sealed under one key before the next is derived: at most 64 GiB of 1 MiB frames,
/// far inside AES-GCM's bound for one key (RFC 8446 §5.5: 2^24.5 full TLS records, ~380 GB).
pub const FRAMES_PER_KEY: u64 = 1 << 16;

/// What the holder sends first, through TLS itself: after it the connection speaks frames.
pub const HELLO: &[u8; 8] = b"frames/1";

/// Which end of the connection a side is: each seals with its own direction's key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The end that connected (fetches objects).
    Client,
    /// The end that accepted (serves objects).
    Server,
}

/// Why a frame was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    /// Its tag does not match: changed on the way, replayed, reordered, or not from the peer.
    #[error("a frame failed its authentication (changed, replayed or reordered on the way)")]
    Forged,
    /// Its header announces more than the reader takes.
    #[error("a frame announces {announced} bytes, at most {limit} expected here")]
    TooLong {
        /// Bytes announced.
        announced: usize,
        /// Bytes the reader takes.
        limit: usize,
    },
    /// A direction sent more frames than it has nonces (2^64): never in practice.
    #[error("the connection ran out of frame nonces")]
    Exhausted,
}

impl From<FrameError> for io::Error {
    fn from(e: FrameError) -> Self {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// One direction's secret, current key and IV, and next sequence number.
struct Direction {
    secret: aws_lc_rs::hmac::Key,
    key: LessSafeKey,
    iv: [u8; NONCE_LEN],
    sequence: u64,
}

impl Direction {
    fn new(secret: &[u8]) -> Self {
        let secret = aws_lc_rs::hmac::Key::new(aws_lc_rs::hmac::HMAC_SHA256, secret);
        let (key, iv) = derive(&secret, 0);
        Self {
            secret,
            key,
            iv,
            sequence: 0,
        }
    }

    /// The next frame's nonce, as TLS 1.3 makes a record's: never the same twice under one
    /// key. Every [`FRAMES_PER_KEY`] frames the key and IV are derived anew first.
    fn next_nonce(&mut self) -> Result<Nonce, FrameError> {
        let sequence = self.sequence;
        self.sequence = sequence.checked_add(1).ok_or(FrameError::Exhausted)?;
        if sequence > 0 && sequence.is_multiple_of(FRAMES_PER_KEY) {
            (self.key, self.iv) = derive(&self.secret, sequence / FRAMES_PER_KEY);
        }
        let mut nonce = self.iv;
        for (byte, s) in nonce[NONCE_LEN - 8..].iter_mut().zip(sequence.to_be_bytes()) {
            *byte ^= s;
        }
        Ok(Nonce::assume_unique_for_key(nonce))
    }
}

/// The AES-128-GCM key and IV of `generation` (a [`FRAMES_PER_KEY`] run of frames).
fn derive(secret: &aws_lc_rs::hmac::Key, generation: u64) -> (LessSafeKey, [u8; NONCE_LEN]) {
    let part = |label: &[u8]| {
        let mut context = aws_lc_rs::hmac::Context::with_key(secret);
        context.update(label);
        context.update(&generation.to_be_bytes());
        context.sign()
    };
    let key = part(b"regatta frames key");
    let key = UnboundKey::new(&AES_128_GCM, &key.as_ref()[..KEY_LEN]).expect("an AES-128 key is 16 bytes");
    let mut iv = [0u8; NONCE_LEN];
    iv.copy_from_slice(&part(b"regatta frames iv").as_ref()[..NONCE_LEN]);
    (LessSafeKey::new(key), iv)
}

/// Both directions' keys of one connection, seen from one side.
pub struct Keys {
    /// What this side sends with.
    pub send: Sealer,
    /// What this side receives with.
    pub receive: Opener,
}

/// Seals the frames one side sends.
pub struct Sealer(Direction);

/// Opens the frames one side receives.
pub struct Opener(Direction);

/// A frame's header: the payload's length and a word for the caller. The header is
/// authenticated (AES-GCM's additional data) but not encrypted: nothing derived from the
/// payload may go in the word.
pub fn header(len: usize, word: u32) -> [u8; HEADER_LEN] {
    let mut header = [0u8; HEADER_LEN];
    header[..4].copy_from_slice(&(len as u32).to_le_bytes());
    header[4..].copy_from_slice(&word.to_le_bytes());
    header
}

/// A header's payload length and word.
pub fn parse_header(header: &[u8; HEADER_LEN]) -> (usize, u32) {
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
    let word = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
    (len, word)
}

impl Keys {
    /// The keys `side` uses, from the bytes both ends exported (client to server first).
    pub fn from_exported(material: &[u8; EXPORTED_LEN], side: Side) -> Self {
        let (to_server, to_client) = material.split_at(SECRET_LEN);
        let (to_server, to_client) = (Direction::new(to_server), Direction::new(to_client));
        let (send, receive) = match side {
            Side::Client => (to_server, to_client),
            Side::Server => (to_client, to_server),
        };
        Self {
            send: Sealer(send),
            receive: Opener(receive),
        }
    }

    /// Seals `payload` with this side's sending key (see [`Sealer::seal`]).
    pub fn seal(&mut self, word: u32, payload: &[u8], frame: &mut Vec<u8>) -> Result<(), FrameError> {
        self.send.seal(word, payload, frame)
    }

    /// Opens a frame with this side's receiving key (see [`Opener::open`]).
    pub fn open(
        &mut self,
        header: &[u8; HEADER_LEN],
        in_out: &mut [u8],
        tag: &[u8; TAG_LEN],
    ) -> Result<(), FrameError> {
        self.receive.open(header, in_out, tag)
    }
}

impl Sealer {
    /// Seals `payload` into `frame` (cleared first): header, ciphertext, tag. One pass over
    /// the payload, which is never copied in the clear.
    pub fn seal(&mut self, word: u32, payload: &[u8], frame: &mut Vec<u8>) -> Result<(), FrameError> {
        let header = header(payload.len(), word);
        let nonce = self.0.next_nonce()?;
        frame.clear();
        frame.resize(HEADER_LEN + payload.len() + TAG_LEN, 0);
        frame[..HEADER_LEN].copy_from_slice(&header);
        let (ciphertext, tag) = frame[HEADER_LEN..].split_at_mut(payload.len());
        self.0
            .key
            .seal_out_of_place_scatter(nonce, Aad::from(header), payload, ciphertext, &[], tag)
            .expect("the ciphertext and tag buffers are the payload's and the tag's lengths");
        Ok(())
    }
}

impl Opener {
    /// Opens a received frame's ciphertext in place. The next frame's nonce is used up
    /// either way: after a refused frame the connection is not to be read on.
    pub fn open(
        &mut self,
        header: &[u8; HEADER_LEN],
        in_out: &mut [u8],
        tag: &[u8; TAG_LEN],
    ) -> Result<(), FrameError> {
        let nonce = self.0.next_nonce()?;
        self.0
            .key
            .open_in_place_separate_tag(nonce, Aad::from(*header), tag, in_out)
            .map_err(|_| FrameError::Forged)?;
        Ok(())
    }
}

/// A TCP connection speaking sealed frames.
pub struct SealedStream {
    tcp: TcpStream,
    keys: Keys,
    /// The frame being sent, kept for the next one.
    frame: Vec<u8>,
}

/// Exports the frame keys from a finished TLS session.
fn export<Data>(connection: &rustls::ConnectionCommon<Data>) -> io::Result<[u8; EXPORTED_LEN]> {
    connection
        .export_keying_material([0u8; EXPORTED_LEN], EXPORTER_LABEL, None)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("cannot export frame keys: {e}")))
}

/// Refuses to leave TLS with bytes still in rustls's hands (they would be lost).
fn nothing_pending(wants_write: bool) -> io::Result<()> {
    if wants_write {
        return Err(io::Error::other("TLS data left unsent when switching to frames"));
    }
    Ok(())
}

impl SealedStream {
    /// The connecting side: reads the holder's hello through TLS, then leaves TLS for frames.
    /// The holder sends nothing after its hello until this side's first frame, so no frame
    /// byte can be left in rustls's buffers.
    pub async fn client(mut tls: tokio_rustls::client::TlsStream<TcpStream>) -> io::Result<Self> {
        let mut hello = [0u8; HELLO.len()];
        tls.read_exact(&mut hello).await?;
        if &hello != HELLO {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the holder speaks another object-transfer version",
            ));
        }
        let (tcp, connection) = tls.into_inner();
        nothing_pending(connection.wants_write())?;
        let material = export(&connection)?;
        Ok(Self::new(tcp, Keys::from_exported(&material, Side::Client)))
    }

    /// The accepting side: sends the hello through TLS, then leaves TLS for frames. The
    /// caller sends nothing before the hello, so rustls holds no frame byte of its.
    pub async fn server(mut tls: tokio_rustls::server::TlsStream<TcpStream>) -> io::Result<Self> {
        tls.write_all(HELLO).await?;
        tls.flush().await?;
        let (tcp, connection) = tls.into_inner();
        nothing_pending(connection.wants_write())?;
        let material = export(&connection)?;
        Ok(Self::new(tcp, Keys::from_exported(&material, Side::Server)))
    }

    fn new(tcp: TcpStream, keys: Keys) -> Self {
        Self {
            tcp,
            keys,
            frame: Vec::new(),
        }
    }

    /// Sends one frame.
    pub async fn send(&mut self, word: u32, payload: &[u8]) -> io::Result<()> {
        self.keys.seal(word, payload, &mut self.frame)?;
        self.tcp.write_all(&self.frame).await?;
        // A chunk's buffer is not kept between objects; a message's is small.
        if self.frame.capacity() > 2 * MAX_MESSAGE && payload.len() <= MAX_MESSAGE {
            self.frame = Vec::new();
        }
        Ok(())
    }

    /// Receives one message (a frame of at most a few hundred bytes): its word and payload.
    pub async fn receive_message(&mut self) -> io::Result<(u32, Vec<u8>)> {
        self.receive_message_or_end()
            .await?
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the connection"))
    }

    /// Like [`SealedStream::receive_message`], but a connection the peer closed cleanly
    /// before a new frame (an idle connection's end) is `Ok(None)`.
    pub async fn receive_message_or_end(&mut self) -> io::Result<Option<(u32, Vec<u8>)>> {
        let mut header = [0u8; HEADER_LEN];
        let first = self.tcp.read(&mut header).await?;
        if first == 0 {
            return Ok(None);
        }
        self.tcp.read_exact(&mut header[first..]).await?;
        let (len, word) = parse_header(&header);
        within(len, MAX_MESSAGE)?;
        let mut payload = vec![0u8; len];
        self.finish(&header, &mut payload).await?;
        Ok(Some((word, payload)))
    }

    /// Receives one frame straight into `destination`, opened in place there: its word and
    /// the payload's length. A frame longer than `destination` is refused unread.
    pub async fn receive_into(&mut self, destination: &mut [u8]) -> io::Result<(u32, usize)> {
        let header = self.read_header().await?;
        let (len, word) = parse_header(&header);
        within(len, destination.len())?;
        self.finish(&header, &mut destination[..len]).await?;
        Ok((word, len))
    }

    /// The TCP stream (made blocking) and the keys, for a caller that moves frames from
    /// plain threads with [`send_frame`] and [`receive_frame_into`].
    pub fn into_blocking(self) -> io::Result<(std::net::TcpStream, Keys)> {
        let tcp = self.tcp.into_std()?;
        tcp.set_nonblocking(false)?;
        Ok((tcp, self.keys))
    }

    async fn read_header(&mut self) -> io::Result<[u8; HEADER_LEN]> {
        let mut header = [0u8; HEADER_LEN];
        self.tcp.read_exact(&mut header).await?;
        Ok(header)
    }

    /// Reads the ciphertext into `payload` and the tag after it, and opens it in place.
    async fn finish(&mut self, header: &[u8; HEADER_LEN], payload: &mut [u8]) -> io::Result<()> {
        self.tcp.read_exact(payload).await?;
        let mut tag = [0u8; TAG_LEN];
        self.tcp.read_exact(&mut tag).await?;
        self.keys.open(header, payload, &tag)?;
        Ok(())
    }
}

/// Refuses a frame that announces more than the reader takes, before reading it.
fn within(len: usize, limit: usize) -> Result<(), FrameError> {
    if len > limit {
        return Err(FrameError::TooLong { announced: len, limit });
    }
    Ok(())
}

/// Sends one frame on a blocking stream (`frame` is the reused send buffer).
pub fn send_frame(
    stream: &mut impl std::io::Write,
    sealer: &mut Sealer,
    frame: &mut Vec<u8>,
    word: u32,
    payload: &[u8],
) -> io::Result<()> {
    sealer.seal(word, payload, frame)?;
    stream.write_all(frame)
}

/// Receives one frame from a blocking stream straight into `destination`, opened in place:
/// its word and the payload's length. A frame longer than `destination` is refused unread.
pub fn receive_frame_into(
    stream: &mut impl std::io::Read,
    opener: &mut Opener,
    destination: &mut [u8],
) -> io::Result<(u32, usize)> {
    let mut header = [0u8; HEADER_LEN];
    stream.read_exact(&mut header)?;
    let (len, word) = parse_header(&header);
    within(len, destination.len())?;
    stream.read_exact(&mut destination[..len])?;
    let mut tag = [0u8; TAG_LEN];
    stream.read_exact(&mut tag)?;
    opener.open(&header, &mut destination[..len], &tag)?;
    Ok((word, len))
}

/// The TLS acceptor and connector of a service whose connections leave TLS for frames:
/// the cluster's mutual TLS with its own ALPN `alpn`, and no session tickets (a ticket is
/// a TLS message sent after the handshake, which the caller would find before the first
/// frame).
pub fn tls_for_frames(
    identity: &crate::identity::TlsIdentity,
    alpn: &[u8],
) -> (tokio_rustls::TlsAcceptor, tokio_rustls::TlsConnector) {
    let (server, client) = identity.with_alpn(alpn);
    let mut server = (*server).clone();
    server.send_tls13_tickets = 0;
    (
        tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(server)),
        tokio_rustls::TlsConnector::from(client),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Keys, Keys) {
        let material: [u8; EXPORTED_LEN] = std::array::from_fn(|i| (i * 7 + 3) as u8);
        (
            Keys::from_exported(&material, Side::Client),
            Keys::from_exported(&material, Side::Server),
        )
    }

    /// Splits a sealed frame into its parts.
    fn parts(frame: &[u8]) -> ([u8; HEADER_LEN], Vec<u8>, [u8; TAG_LEN]) {
        let header: [u8; HEADER_LEN] = frame[..HEADER_LEN].try_into().unwrap();
        let tag: [u8; TAG_LEN] = frame[frame.len() - TAG_LEN..].try_into().unwrap();
        (header, frame[HEADER_LEN..frame.len() - TAG_LEN].to_vec(), tag)
    }

    #[test]
    fn frames_open_on_the_other_side_in_order_and_hide_their_payload() {
        let (mut client, mut server) = pair();
        let mut frame = Vec::new();
        for (i, payload) in [&b"first request"[..], b"", b"second"].into_iter().enumerate() {
            client.seal(i as u32, payload, &mut frame).unwrap();
            let (header, mut body, tag) = parts(&frame);
            assert_eq!(parse_header(&header), (payload.len(), i as u32));
            if payload.len() > 4 {
                assert_ne!(&body[..], payload, "the payload is not sent in the clear");
            }
            server.open(&header, &mut body, &tag).unwrap();
            assert_eq!(&body[..], payload);
        }
        // And the other way, with the other direction's key.
        server.seal(7, b"reply", &mut frame).unwrap();
        let (header, mut body, tag) = parts(&frame);
        client.open(&header, &mut body, &tag).unwrap();
        assert_eq!(&body[..], b"reply");
    }

    #[test]
    fn a_changed_replayed_reordered_or_reflected_frame_is_refused() {
        let mut frame = Vec::new();
        let payload = vec![42u8; 1000];
        // Any one byte changed: header, ciphertext or tag.
        for at in [0, 5, HEADER_LEN, HEADER_LEN + 500, HEADER_LEN + 1000 + 3] {
            let (mut client, mut server) = pair();
            client.seal(9, &payload, &mut frame).unwrap();
            frame[at] ^= 1;
            let (header, mut body, tag) = parts(&frame);
            assert_eq!(
                server.open(&header, &mut body, &tag),
                Err(FrameError::Forged),
                "byte {at}"
            );
        }
        // The same frame twice: the second is a replay.
        let (mut client, mut server) = pair();
        client.seal(1, &payload, &mut frame).unwrap();
        let (header, body, tag) = parts(&frame);
        server.open(&header, &mut body.clone(), &tag).unwrap();
        assert_eq!(server.open(&header, &mut body.clone(), &tag), Err(FrameError::Forged));
        // Two frames swapped.
        let (mut client, mut server) = pair();
        let mut second = Vec::new();
        client.seal(1, b"one", &mut frame).unwrap();
        client.seal(2, b"two", &mut second).unwrap();
        let (header, mut body, tag) = parts(&second);
        assert_eq!(server.open(&header, &mut body, &tag), Err(FrameError::Forged));
        // A frame sent back to its sender (its own direction's key is not the one it opens with).
        let (mut client, _) = pair();
        client.seal(1, b"mirror", &mut frame).unwrap();
        let (header, mut body, tag) = parts(&frame);
        assert_eq!(client.open(&header, &mut body, &tag), Err(FrameError::Forged));
    }

    #[test]
    fn a_blocking_reader_takes_frames_in_place_and_refuses_one_longer_than_its_room() {
        let (mut client, mut server) = pair();
        let (mut wire, mut frame) = (Vec::new(), Vec::new());
        send_frame(&mut wire, &mut client.send, &mut frame, 5, b"0123456789").unwrap();
        send_frame(&mut wire, &mut client.send, &mut frame, 6, &[9u8; 2000]).unwrap();
        let mut reader = std::io::Cursor::new(wire);
        let mut room = [0u8; 1000];
        assert_eq!(
            receive_frame_into(&mut reader, &mut server.receive, &mut room).unwrap(),
            (5, 10)
        );
        assert_eq!(&room[..10], b"0123456789");
        let refused = receive_frame_into(&mut reader, &mut server.receive, &mut room).unwrap_err();
        let refused = refused.get_ref().and_then(|e| e.downcast_ref::<FrameError>());
        assert_eq!(
            refused,
            Some(&FrameError::TooLong {
                announced: 2000,
                limit: 1000
            })
        );
        assert_eq!(
            reader.position() as usize,
            2 * HEADER_LEN + 10 + TAG_LEN,
            "nothing past the header read"
        );
    }

    #[test]
    fn nonces_are_the_iv_xor_the_sequence_number() {
        let mut direction = Direction::new(&[1u8; SECRET_LEN]);
        let iv = direction.iv;
        let first = direction.next_nonce().unwrap();
        let second = direction.next_nonce().unwrap();
        assert_eq!(first.as_ref(), &iv);
        let mut expected = iv;
        expected[NONCE_LEN - 1] ^= 1;
        assert_eq!(second.as_ref(), &expected);
        direction.sequence = u64::MAX;
        assert!(
            direction.next_nonce().is_err(),
            "the last sequence number is never used"
        );
    }

    #[test]
    fn both_sides_move_to_a_new_key_together_and_the_old_key_opens_nothing_after() {
        let (mut client, mut server) = pair();
        client.send.0.sequence = FRAMES_PER_KEY - 1;
        server.receive.0.sequence = FRAMES_PER_KEY - 1;
        let iv_before = client.send.0.iv;
        let mut frame = Vec::new();
        for (i, payload) in [&b"last of the first key"[..], b"first of the next", b"second"]
            .into_iter()
            .enumerate()
        {
            client.seal(i as u32, payload, &mut frame).unwrap();
            let (header, mut body, tag) = parts(&frame);
            server.open(&header, &mut body, &tag).unwrap();
            assert_eq!(&body[..], payload);
        }
        assert_ne!(client.send.0.iv, iv_before, "a new IV (and key) past the boundary");
        assert_eq!(client.send.0.iv, server.receive.0.iv);
        // The receiver's new key is the sender's: a frame the old key sealed fails now.
        let (mut old, _) = pair();
        old.seal(3, b"under the first key", &mut frame).unwrap();
        let (header, mut body, tag) = parts(&frame);
        assert_eq!(server.open(&header, &mut body, &tag), Err(FrameError::Forged));
    }

    /// Bounded fuzzing: a sealed frame changed anywhere (header, ciphertext or tag) is
    /// refused, and an unchanged one opens to its payload.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(crate::fuzz_config(256))]

            #[test]
            fn a_frame_changed_anywhere_is_refused(
                material in proptest::collection::vec(any::<u8>(), EXPORTED_LEN),
                payload in proptest::collection::vec(any::<u8>(), 0..2048),
                word in any::<u32>(),
                at in any::<prop::sample::Index>(),
                flip in 1u8..=255,
            ) {
                let material: [u8; EXPORTED_LEN] = material.try_into().unwrap();
                let mut client = Keys::from_exported(&material, Side::Client);
                let mut frame = Vec::new();
                client.seal(word, &payload, &mut frame).unwrap();
                let open = |frame: &[u8]| {
                    let mut server = Keys::from_exported(&material, Side::Server);
                    let header: [u8; HEADER_LEN] = frame[..HEADER_LEN].try_into().unwrap();
                    let (len, got_word) = parse_header(&header);
                    if len + HEADER_LEN + TAG_LEN != frame.len() {
                        return Err(FrameError::Forged);
                    }
                    let mut body = frame[HEADER_LEN..HEADER_LEN + len].to_vec();
                    let tag: [u8; TAG_LEN] = frame[HEADER_LEN + len..].try_into().unwrap();
                    server.open(&header, &mut body, &tag).map(|()| (got_word, body))
                };
                let (got_word, body) = open(&frame).expect("the frame as sealed opens");
                prop_assert_eq!(got_word, word);
                prop_assert_eq!(&body, &payload);
                let i = at.index(frame.len());
                frame[i] ^= flip;
                prop_assert!(open(&frame).is_err(), "byte {} changed and opened", i);
            }
        }
    }
}
