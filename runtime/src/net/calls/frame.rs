//! The call channel's frames, as plain data: no sockets here.
//!
//! A request is `[kind: u8][seq: u64][actor: u64][len: u32][payload]`, a reply
//! `[seq: u64][status: u8][len: u32][payload]`, integers little-endian. `seq` pairs a reply
//! with its call on one connection; casts carry one too (unused) so both kinds share a
//! header. A length over [`MAX_PAYLOAD_BYTES`] or an unknown kind or status is refused
//! before any payload is read, so a peer cannot make a node allocate what it likes.
//!
//! A timed call ([`RequestKind::TimedCall`]) that its actor answered comes back as
//! [`ReplyStatus::AnsweredTimed`]: the payload starts with the serving side's
//! [`ServerStamps`], then the answer. Its other replies (not hosted, lost) are plain.

use crate::error::{Error, Result};
use crate::net::wire::MAX_MESSAGE_BYTES;
use regatta_proto::ActorId;

/// Largest payload either side accepts: an actor message's limit, plus room for a reply's
/// `Result` wrapper.
pub(crate) const MAX_PAYLOAD_BYTES: usize = MAX_MESSAGE_BYTES + 4096;

/// Bytes of a request header.
pub(crate) const REQUEST_HEADER_BYTES: usize = 21;
/// Bytes of a reply header.
pub(crate) const REPLY_HEADER_BYTES: usize = 13;

/// What a request asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RequestKind {
    /// Deliver and answer.
    Call,
    /// Deliver only.
    Cast,
    /// Deliver and answer, with the serving side's [`ServerStamps`] before the answer.
    TimedCall,
}

/// A request's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RequestHeader {
    pub(crate) kind: RequestKind,
    pub(crate) seq: u64,
    pub(crate) actor: ActorId,
    pub(crate) len: usize,
}

/// How a call ended on the serving node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReplyStatus {
    /// The payload is the answer, as the actor's host encoded it.
    Answered,
    /// The actor took the call and stopped (or its node reset) before answering; the
    /// payload is empty.
    Lost,
    /// As `Answered`, the answer preceded by [`ServerStamps`] (a timed call's reply).
    AnsweredTimed,
}

/// When the serving side passed each point of one timed call, in nanoseconds of the
/// host's wall clock ([`wall_clock_ns`]): comparable with the caller's stamps when both
/// run on one host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ServerStamps {
    /// The request was read and decrypted off the connection.
    pub(crate) read: u64,
    /// It was in the actor's queue.
    pub(crate) queued: u64,
    /// The connection's task held the actor's answer.
    pub(crate) answered: u64,
    /// The reply frame was built and about to be written.
    pub(crate) writing: u64,
}

impl ServerStamps {
    /// Encoded length.
    pub(crate) const BYTES: usize = 32;

    /// The stamps followed by `answer`: a timed reply's payload.
    pub(crate) fn prefix(&self, answer: &[u8]) -> Vec<u8> {
        let mut payload = Vec::with_capacity(Self::BYTES + answer.len());
        for stamp in [self.read, self.queued, self.answered, self.writing] {
            payload.extend_from_slice(&stamp.to_le_bytes());
        }
        payload.extend_from_slice(answer);
        payload
    }

    /// Reads the stamps that lead a timed reply's payload.
    pub(crate) fn parse(bytes: &[u8; Self::BYTES]) -> Self {
        Self {
            read: u64_at(bytes, 0),
            queued: u64_at(bytes, 8),
            answered: u64_at(bytes, 16),
            writing: u64_at(bytes, 24),
        }
    }
}

/// Nanoseconds since the Unix epoch by the system clock: one clock for every process of a
/// host, unlike [`std::time::Instant`], so stamps taken in two processes subtract.
pub(crate) fn wall_clock_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
}

/// A reply's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReplyHeader {
    pub(crate) seq: u64,
    pub(crate) status: ReplyStatus,
    pub(crate) len: usize,
}

fn check_len(len: u32, what: &str) -> Result<usize> {
    let len = len as usize;
    if len > MAX_PAYLOAD_BYTES {
        return Err(Error::Decode {
            what: what.to_string(),
            reason: format!("a payload of {len} bytes exceeds the {MAX_PAYLOAD_BYTES} byte limit"),
        });
    }
    Ok(len)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(word)
}

impl RequestHeader {
    /// The header followed by `payload`, in one buffer (one TLS record for small calls).
    pub(crate) fn frame(kind: RequestKind, seq: u64, actor: ActorId, payload: &[u8]) -> Vec<u8> {
        let mut frame = Vec::with_capacity(REQUEST_HEADER_BYTES + payload.len());
        frame.push(match kind {
            RequestKind::Call => 1,
            RequestKind::Cast => 2,
            RequestKind::TimedCall => 3,
        });
        frame.extend_from_slice(&seq.to_le_bytes());
        frame.extend_from_slice(&actor.0.to_le_bytes());
        frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        frame.extend_from_slice(payload);
        frame
    }

    /// Parses a request header.
    pub(crate) fn parse(bytes: &[u8; REQUEST_HEADER_BYTES]) -> Result<Self> {
        let what = "a call channel request";
        let kind = match bytes[0] {
            1 => RequestKind::Call,
            2 => RequestKind::Cast,
            3 => RequestKind::TimedCall,
            other => {
                return Err(Error::Decode {
                    what: what.into(),
                    reason: format!("unknown request kind {other}"),
                })
            }
        };
        Ok(Self {
            kind,
            seq: u64_at(bytes, 1),
            actor: ActorId(u64_at(bytes, 9)),
            len: check_len(u32_at(bytes, 17), what)?,
        })
    }
}

impl ReplyHeader {
    /// The header followed by `payload`, in one buffer.
    pub(crate) fn frame(seq: u64, status: ReplyStatus, payload: &[u8]) -> Vec<u8> {
        let mut frame = Vec::with_capacity(REPLY_HEADER_BYTES + payload.len());
        frame.extend_from_slice(&seq.to_le_bytes());
        frame.push(match status {
            ReplyStatus::Answered => 0,
            ReplyStatus::Lost => 1,
            ReplyStatus::AnsweredTimed => 2,
        });
        frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        frame.extend_from_slice(payload);
        frame
    }

    /// Parses a reply header.
    pub(crate) fn parse(bytes: &[u8; REPLY_HEADER_BYTES]) -> Result<Self> {
        let what = "a call channel reply";
        let status = match bytes[8] {
            0 => ReplyStatus::Answered,
            1 => ReplyStatus::Lost,
            2 => ReplyStatus::AnsweredTimed,
            other => {
                return Err(Error::Decode {
                    what: what.into(),
                    reason: format!("unknown reply status {other}"),
                })
            }
        };
        Ok(Self {
            seq: u64_at(bytes, 0),
            status,
            len: check_len(u32_at(bytes, 9), what)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request_header(frame: &[u8]) -> [u8; REQUEST_HEADER_BYTES] {
        frame[..REQUEST_HEADER_BYTES].try_into().unwrap()
    }

    #[test]
    fn requests_round_trip_with_their_payload_after_the_header() {
        for kind in [RequestKind::Call, RequestKind::Cast, RequestKind::TimedCall] {
            let frame = RequestHeader::frame(kind, 7, ActorId(0x0102_0304_0506_0708), b"hello");
            let header = RequestHeader::parse(&request_header(&frame)).unwrap();
            assert_eq!(
                header,
                RequestHeader {
                    kind,
                    seq: 7,
                    actor: ActorId(0x0102_0304_0506_0708),
                    len: 5
                }
            );
            assert_eq!(&frame[REQUEST_HEADER_BYTES..], b"hello");
        }
    }

    #[test]
    fn replies_round_trip_with_their_status() {
        for status in [ReplyStatus::Answered, ReplyStatus::Lost, ReplyStatus::AnsweredTimed] {
            let frame = ReplyHeader::frame(u64::MAX, status, &[9; 3]);
            let header = ReplyHeader::parse(frame[..REPLY_HEADER_BYTES].try_into().unwrap()).unwrap();
            assert_eq!(
                header,
                ReplyHeader {
                    seq: u64::MAX,
                    status,
                    len: 3
                }
            );
            assert_eq!(&frame[REPLY_HEADER_BYTES..], &[9; 3]);
        }
    }

    #[test]
    fn unknown_kinds_and_statuses_are_refused() {
        let mut frame = RequestHeader::frame(RequestKind::Call, 1, ActorId(1), b"");
        frame[0] = 4;
        assert!(matches!(
            RequestHeader::parse(&request_header(&frame)),
            Err(Error::Decode { reason, .. }) if reason.contains("kind 4")
        ));
        let mut reply = ReplyHeader::frame(1, ReplyStatus::Answered, b"");
        reply[8] = 9;
        assert!(ReplyHeader::parse(reply[..REPLY_HEADER_BYTES].try_into().unwrap()).is_err());
    }

    #[test]
    fn server_stamps_lead_the_answer_and_read_back() {
        let stamps = ServerStamps {
            read: 1,
            queued: u64::MAX,
            answered: 3,
            writing: 0x0102_0304_0506_0708,
        };
        let payload = stamps.prefix(b"answer");
        let (head, answer) = payload.split_at(ServerStamps::BYTES);
        assert_eq!(ServerStamps::parse(head.try_into().unwrap()), stamps);
        assert_eq!(answer, b"answer");
        assert_eq!(stamps.prefix(b"").len(), ServerStamps::BYTES);
    }

    #[test]
    fn a_length_over_the_limit_is_refused_before_any_payload() {
        let mut frame = RequestHeader::frame(RequestKind::Call, 1, ActorId(1), b"");
        frame[17..21].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            RequestHeader::parse(&request_header(&frame)),
            Err(Error::Decode { reason, .. }) if reason.contains("exceeds")
        ));
        let mut at_limit = RequestHeader::frame(RequestKind::Cast, 1, ActorId(1), b"");
        at_limit[17..21].copy_from_slice(&(MAX_PAYLOAD_BYTES as u32).to_le_bytes());
        assert_eq!(
            RequestHeader::parse(&request_header(&at_limit)).unwrap().len,
            MAX_PAYLOAD_BYTES
        );
    }
}
