//! The one message type every remote Regatta actor receives, and the codec around it.
//!
//! `ractor_cluster` serializes messages through `BytesConvertable`, whose decoders may panic
//! on short input. Regatta's actors instead receive [`Wire`]: an opaque byte payload that
//! ractor forwards untouched, decoded by Regatta with bincode into a typed value or a clear
//! [`Failure::BadMessage`] reply. Malformed bytes from the network therefore never panic a
//! node; they get an error reply or are dropped.

use std::time::Duration;

use bincode::Options;
use ractor::message::{BoxedDowncastErr, SerializedMessage};
use ractor::{ActorCell, ActorRef, RpcReplyPort};
use serde::de::DeserializeOwned;
use serde::Serialize;

use regatta_proto::{ActorId, Failure};

/// A cast's share of the room its connection has for casts waiting at actors (none for a
/// cast that came another way): held while the cast waits in its actor's queue, so a caller
/// that casts faster than the actors take them is held back at a bound, as calls are.
#[derive(Default)]
pub struct Hold(Option<tokio::sync::OwnedSemaphorePermit>);

impl Hold {
    /// A hold of `permit`.
    pub(crate) fn of(permit: tokio::sync::OwnedSemaphorePermit) -> Self {
        Self(Some(permit))
    }
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hold({})", if self.0.is_some() { "held" } else { "none" })
    }
}

/// Largest payload decoded from the wire; ractor_cluster frames are capped below this anyway.
const MAX_DECODE_BYTES: u64 = 64 << 20;

/// A message to a remote-capable Regatta actor.
pub enum Wire {
    /// Fire and forget; the [`Hold`] is the sending connection's room for casts queued
    /// at actors, given back when the message is taken off the queue (dropped).
    Cast(
        Vec<u8>,
        #[expect(dead_code, reason = "a guard: what it holds is given back when it is dropped")] Hold,
    ),
    /// Request/reply: the reply is `Result<T, Failure>` encoded with [`encode`].
    Call(Vec<u8>, RpcReplyPort<Vec<u8>>),
    /// A call to a user actor hosted on the receiving node, sent to that node's router
    /// (user actors are not remote-capable themselves: see `worker/router.rs`). The reply is
    /// the actor's, or [`Failure::NotHosted`].
    CallActor(ActorId, Vec<u8>, RpcReplyPort<Vec<u8>>),
    /// A cast to a user actor hosted on the receiving node, sent to that node's router.
    CastActor(ActorId, Vec<u8>),
    /// Node-local signal (never crosses the network), for the actor's own timers.
    Local(LocalSignal),
}

/// Signals an actor gets from its own node (never over the network).
pub enum LocalSignal {
    /// A periodic timer fired.
    Tick,
    /// The head's state writer finished a write.
    Written,
    /// An asynchronous job finished; the payload is an encoded request to handle locally.
    Deferred(Vec<u8>),
    /// An agent's start task finished constructing an actor and spawned its host.
    Hosted {
        /// The actor.
        actor: regatta_proto::ActorId,
        /// The start attempt.
        attempt: u32,
        /// The host actor.
        host: ractor::ActorCell,
    },
    /// An agent's start task could not start the actor.
    NotStarted(regatta_proto::ActorId),
    /// The head, taking this node's registration, does not want these actors running
    /// here (killed while it could not say so, restarted elsewhere, or unknown to it).
    Unwanted(Vec<regatta_proto::ActorId>),
}

const CAST: &str = "cast";
const CALL: &str = "call";

/// A routed message carries its actor's id as the metadata: 8 bytes, little-endian.
fn actor_metadata(actor: ActorId) -> Option<Vec<u8>> {
    Some(actor.0.to_le_bytes().to_vec())
}

/// The actor a message's metadata names: `Ok(None)` without metadata, `Err` for metadata
/// that is not an actor id (the message is then dropped, as any undecodable one).
fn routed_actor(metadata: Option<Vec<u8>>) -> Result<Option<ActorId>, BoxedDowncastErr> {
    match metadata {
        None => Ok(None),
        Some(bytes) => <[u8; 8]>::try_from(bytes.as_slice())
            .map(|id| Some(ActorId(u64::from_le_bytes(id))))
            .map_err(|_| BoxedDowncastErr),
    }
}

impl ractor::Message for Wire {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        match self {
            Wire::Cast(args, _) => Ok(SerializedMessage::Cast {
                variant: CAST.to_string(),
                args,
                metadata: None,
            }),
            Wire::Call(args, reply) => Ok(SerializedMessage::Call {
                variant: CALL.to_string(),
                args,
                reply,
                metadata: None,
            }),
            Wire::CallActor(actor, args, reply) => Ok(SerializedMessage::Call {
                variant: CALL.to_string(),
                args,
                reply,
                metadata: actor_metadata(actor),
            }),
            Wire::CastActor(actor, args) => Ok(SerializedMessage::Cast {
                variant: CAST.to_string(),
                args,
                metadata: actor_metadata(actor),
            }),
            Wire::Local(_) => Err(BoxedDowncastErr),
        }
    }

    fn deserialize(bytes: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        match bytes {
            SerializedMessage::Cast {
                variant,
                args,
                metadata,
            } if variant == CAST => Ok(match routed_actor(metadata)? {
                None => Wire::Cast(args, Hold::default()),
                Some(actor) => Wire::CastActor(actor, args),
            }),
            SerializedMessage::Call {
                variant,
                args,
                reply,
                metadata,
            } if variant == CALL => Ok(match routed_actor(metadata)? {
                None => Wire::Call(args, reply),
                Some(actor) => Wire::CallActor(actor, args, reply),
            }),
            _ => Err(BoxedDowncastErr),
        }
    }
}

fn options() -> impl Options {
    bincode::DefaultOptions::new()
        .with_limit(MAX_DECODE_BYTES)
        .with_fixint_encoding()
}

/// Encodes a value for the wire.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing plain data into a Vec cannot fail; a failure is a bug in a Serialize impl.
    options()
        .serialize(value)
        .expect("serde types in Regatta's protocol always serialize")
}

/// Encodes a successful call's reply as the caller decodes it, `Result<T, Failure>`, in one
/// pass (no inner encoding of the value wrapped in an outer one).
pub fn encode_ok<T: Serialize>(value: &T) -> Vec<u8> {
    encode(&Ok::<&T, Failure>(value))
}

/// Encodes a failed call's answer; the caller decodes it as `Result<T, Failure>` for any `T`.
pub fn encode_failure(failure: Failure) -> Vec<u8> {
    encode(&Err::<(), Failure>(failure))
}

/// Decodes a value from the wire, naming `what` in the error.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, Failure> {
    options()
        .deserialize(bytes)
        .map_err(|e| Failure::BadMessage(format!("could not decode {what}: {e}")))
}

/// Replies to a call with an encoded result; a caller that went away is not an error here.
pub fn reply<T: Serialize>(port: RpcReplyPort<Vec<u8>>, result: Result<T, Failure>) {
    let _ = port.send(encode(&result));
}

/// How a call to a remote actor ended, before decoding.
pub enum CallError {
    /// The actor could not be reached (stopped, or its node is gone).
    Unreachable(String),
    /// The message never left this process: the session it was to go through had closed
    /// (its node is gone, or ractor_cluster dropped one of two sessions opened to the same
    /// node at once). Sending it again through a fresh route is safe.
    NotSent(String),
    /// No reply in time.
    Timeout,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unreachable(cause) | Self::NotSent(cause) => f.write_str(cause),
            Self::Timeout => f.write_str("no reply in time"),
        }
    }
}

/// The largest message payload: ractor_cluster drops a session that receives a frame
/// over 16 MiB, so larger payloads are refused here, before they are sent.
pub const MAX_MESSAGE_BYTES: usize = 15 << 20;

fn check_size(payload: &[u8]) -> Result<(), CallError> {
    if payload.len() > MAX_MESSAGE_BYTES {
        return Err(CallError::Unreachable(format!(
            "a message of {} bytes exceeds the {} byte limit of actor messages; put large data in the object store and send the ObjectRef",
            payload.len(),
            MAX_MESSAGE_BYTES
        )));
    }
    Ok(())
}

/// Sends `request` and waits up to `timeout` for the raw reply bytes.
pub async fn call_raw(target: &ActorCell, request: Vec<u8>, timeout: Duration) -> Result<Vec<u8>, CallError> {
    check_size(&request)?;
    call_with(target, |port| Wire::Call(request, port), timeout).await
}

/// Sends `request` to user actor `actor` through its node's `router` and waits up to
/// `timeout` for the raw reply bytes.
pub async fn call_actor_raw(
    router: &ActorCell,
    actor: ActorId,
    request: Vec<u8>,
    timeout: Duration,
) -> Result<Vec<u8>, CallError> {
    check_size(&request)?;
    call_with(router, |port| Wire::CallActor(actor, request, port), timeout).await
}

/// Sends a fire-and-forget message to user actor `actor` through its node's `router`.
pub fn cast_actor_raw(router: &ActorCell, actor: ActorId, payload: Vec<u8>) -> Result<(), CallError> {
    check_size(&payload)?;
    let router: ActorRef<Wire> = router.clone().into();
    router
        .send_message(Wire::CastActor(actor, payload))
        .map_err(|e| CallError::Unreachable(format!("could not deliver the message: {e}")))
}

async fn call_with(
    target: &ActorCell,
    message: impl FnOnce(RpcReplyPort<Vec<u8>>) -> Wire,
    timeout: Duration,
) -> Result<Vec<u8>, CallError> {
    let target: ActorRef<Wire> = target.clone().into();
    match target.call(message, Some(timeout)).await {
        Ok(ractor::rpc::CallResult::Success(bytes)) => Ok(bytes),
        Ok(ractor::rpc::CallResult::Timeout) => Err(CallError::Timeout),
        Ok(ractor::rpc::CallResult::SenderError) => Err(CallError::Unreachable(
            "the actor stopped or its node was lost before replying".into(),
        )),
        // Refused at enqueue: the route closed, nothing left this process.
        Err(e @ (ractor::MessagingErr::SendErr(_) | ractor::MessagingErr::ChannelClosed)) => {
            Err(CallError::NotSent(format!("could not deliver the message: {e}")))
        }
        Err(e) => Err(CallError::Unreachable(format!("could not deliver the message: {e}"))),
    }
}

/// Sends a fire-and-forget message.
pub fn cast_raw(target: &ActorCell, payload: Vec<u8>) -> Result<(), CallError> {
    check_size(&payload)?;
    let target: ActorRef<Wire> = target.clone().into();
    target
        .send_message(Wire::Cast(payload, Hold::default()))
        .map_err(|e| CallError::Unreachable(format!("could not deliver the message: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use regatta_proto::HeadRequest;

    #[test]
    fn an_oversized_message_is_refused_before_sending_with_what_to_do() {
        assert!(check_size(&vec![0u8; MAX_MESSAGE_BYTES]).is_ok());
        let refused = check_size(&vec![0u8; MAX_MESSAGE_BYTES + 1]).err();
        assert!(
            matches!(&refused, Some(CallError::Unreachable(cause)) if cause.contains("send the ObjectRef")),
            "{}",
            refused.map(|e| e.to_string()).unwrap_or_default()
        );
        assert_eq!(CallError::Timeout.to_string(), "no reply in time");
    }

    #[test]
    fn garbage_decodes_to_a_failure_not_a_panic() {
        for junk in [
            &b""[..],
            b"\xff\xff\xff\xff\xff\xff\xff\xff\xff",
            b"\x07\x00\x00\x00garbage",
        ] {
            assert!(matches!(
                decode::<HeadRequest>(junk, "head request"),
                Err(Failure::BadMessage(_))
            ));
        }
    }

    #[test]
    fn a_routed_cast_keeps_its_actor_and_bad_metadata_is_refused() {
        use ractor::Message;
        let sent = Wire::CastActor(ActorId(0x0102_0304_0506_0708), vec![7, 8]);
        let serialized = sent.serialize().map_err(|_| "serialize").unwrap();
        match Wire::deserialize(serialized) {
            Ok(Wire::CastActor(ActorId(id), payload)) => {
                assert_eq!(id, 0x0102_0304_0506_0708);
                assert_eq!(payload, vec![7, 8]);
            }
            _ => panic!("a routed cast came back as something else"),
        }
        let plain = Wire::Cast(vec![1], Hold::default())
            .serialize()
            .map_err(|_| "serialize")
            .unwrap();
        assert!(matches!(Wire::deserialize(plain), Ok(Wire::Cast(..))));
        let bad = SerializedMessage::Cast {
            variant: CAST.to_string(),
            args: vec![],
            metadata: Some(vec![1, 2, 3]),
        };
        assert!(Wire::deserialize(bad).is_err());
    }

    #[test]
    fn replies_encoded_once_decode_as_the_callers_result_of_any_type() {
        let ok = encode_ok(&vec![1u32, 2, 3]);
        assert_eq!(
            decode::<Result<Vec<u32>, Failure>>(&ok, "reply").unwrap(),
            Ok(vec![1, 2, 3])
        );
        assert_eq!(
            ok,
            encode(&Ok::<Vec<u32>, Failure>(vec![1, 2, 3])),
            "same bytes as the result"
        );
        let failed = encode_failure(Failure::Handler("no".into()));
        assert_eq!(
            decode::<Result<String, Failure>>(&failed, "reply").unwrap(),
            Err(Failure::Handler("no".into()))
        );
    }

    #[test]
    fn trailing_bytes_mean_the_wrong_type() {
        let text = encode(&"x".to_string());
        assert!(decode::<i64>(&text, "an i64").is_err());
        assert_eq!(decode::<String>(&text, "a string").unwrap(), "x");
    }

    #[test]
    fn huge_length_prefix_is_refused_without_allocating() {
        let mut bytes = vec![2, 0, 0, 0];
        bytes.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode::<(u32, Vec<u8>)>(&bytes, "x").is_err());
    }

    /// Bounded fuzzing: any bytes decode or are refused as a bad message, never a panic
    /// or an allocation as large as a corrupt length claims.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(crate::fuzz_config(512))]

            #[test]
            fn any_bytes_decode_or_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
                let _ = decode::<regatta_proto::HeadRequest>(&bytes, "a head request");
                let _ = decode::<regatta_proto::AgentRequest>(&bytes, "an agent request");
                let _ = decode::<Result<Vec<u8>, Failure>>(&bytes, "a reply");
            }

            #[test]
            fn a_changed_request_decodes_or_is_refused(
                name in proptest::collection::vec(any::<u8>(), 0..64),
                at in any::<prop::sample::Index>(),
                flip in 1u8..=255,
            ) {
                let request = regatta_proto::HeadRequest::EndJob(String::from_utf8_lossy(&name).into_owned());
                let mut bytes = encode(&request);
                let back: regatta_proto::HeadRequest = decode(&bytes, "it").expect("as encoded");
                prop_assert_eq!(encode(&back), bytes.clone());
                let i = at.index(bytes.len());
                bytes[i] ^= flip;
                let _ = decode::<regatta_proto::HeadRequest>(&bytes, "it");
            }
        }
    }
}
