//! Waits for objects ([`HeadRequest::ObjectsWait`]): answered once enough of their ids can
//! be read — a copy in memory on some node, or a spilled one — or at their deadline with
//! those that can. Parked here and looked at again after every request and tick, so a
//! caller asks once instead of polling every id.

use super::{HeadCore, Output, ReplyTo};
use crate::head::output::{answer, Answer};
use crate::object::{Missing, ObjectId};
use crate::protocol::Failure;

/// A parked `ObjectsWait`.
pub(super) struct ObjectsWait {
    ids: Vec<ObjectId>,
    wanted: usize,
    deadline_ms: u64,
    pub(super) to: ReplyTo,
}

impl HeadCore {
    /// Answers a wait now when enough of `ids` are readable (or none can be waited for),
    /// else parks it until they are or `timeout_ms` passes.
    pub(super) fn wait_objects(
        &mut self,
        ids: Vec<ObjectId>,
        wanted: usize,
        timeout_ms: u64,
        to: Option<ReplyTo>,
        now: u64,
        out: &mut Vec<Output>,
    ) {
        let Some(to) = to else { return };
        let wait = ObjectsWait {
            wanted: wanted.min(ids.len()),
            ids,
            deadline_ms: now.saturating_add(timeout_ms),
            to,
        };
        if let Some(ready) = self.answer_of(&wait, now) {
            answer(Some(to), Answer::Ready(ready), out);
        } else {
            self.object_waits.push(wait);
        }
    }

    /// Answers the parked waits that are satisfied or past their deadline. Their ids are
    /// looked up again only after an object request or a lost node changed the directory,
    /// so heartbeats and actor requests cost nothing per parked id.
    pub(super) fn settle_waits(&mut self, now: u64, out: &mut Vec<Output>) {
        let stale = std::mem::take(&mut self.object_waits_stale);
        if self.object_waits.is_empty() || !stale && self.object_waits.iter().all(|w| now < w.deadline_ms) {
            return;
        }
        let waits = std::mem::take(&mut self.object_waits);
        for wait in waits {
            match self.answer_of(&wait, now) {
                Some(ready) => answer(Some(wait.to), Answer::Ready(ready), out),
                None => self.object_waits.push(wait),
            }
        }
    }

    /// The wait's answer if it is due: the readable ids once `wanted` are (or at the
    /// deadline), a failure when one of them was lost with its node.
    fn answer_of(&self, wait: &ObjectsWait, now: u64) -> Option<Result<Vec<ObjectId>, Failure>> {
        let mut ready = Vec::new();
        for &id in &wait.ids {
            match self.directory.locate(id) {
                Ok(location) if !location.sources.is_empty() || location.spilled.is_some() => ready.push(id),
                Ok(_) | Err(Missing::Unknown) => {}
                Err(missing @ Missing::Lost { .. }) => return Some(Err(super::objects::object_missing(id, missing))),
            }
        }
        (ready.len() >= wait.wanted || now >= wait.deadline_ms).then_some(Ok(ready))
    }
}
