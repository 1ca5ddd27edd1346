//! Objects handed to same-host peers through shared memory: a sealed segment made once
//! per object on a peer's first pull, kept while the object is held here, and read by
//! every same-host reader as a mapping.

use std::collections::HashMap;
use std::sync::Arc;

use regatta_object_store::{ObjectId, Segment};

use super::ObjectService;

/// Smallest object handed to a same-host peer through shared memory: below it streaming
/// costs about as little, and a segment holds a descriptor for as long as the object is held.
pub const SHARED_MEMORY_MIN_BYTES: u64 = 1 << 20;

/// Most shared-memory segments one process holds at once (each is an open descriptor);
/// beyond it objects are streamed to same-host peers too.
pub const MAX_SEGMENTS: usize = 256;

/// Whether to make a shared-memory segment for an object of `len` bytes while holding
/// `segments_held` of them.
pub(super) fn worth_sharing(len: u64, segments_held: usize) -> bool {
    len >= SHARED_MEMORY_MIN_BYTES && segments_held < MAX_SEGMENTS
}

impl ObjectService {
    pub(super) fn segments(&self) -> std::sync::MutexGuard<'_, HashMap<ObjectId, Arc<Segment>>> {
        self.segments.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The object's shared-memory segment for a same-host peer: the one made before, else
    /// (for an object of at least [`SHARED_MEMORY_MIN_BYTES`]) a new one, one copy of the
    /// bytes, after which this store holds the mapping instead of its own copy (the object is
    /// in memory once on the host however many processes read it). Blocking: runs on a
    /// blocking thread. The copy is made without holding the segments lock, which release
    /// and spill take on async threads.
    pub(super) fn share(&self, id: ObjectId) -> Option<Arc<Segment>> {
        let gate = {
            let mut making = self.making.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            making.entry(id).or_default().clone()
        };
        let shared = {
            let _maker = gate.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            self.share_once(id)
        };
        let mut making = self.making.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // The last of the peers that waited removes the gate.
        if Arc::strong_count(&gate) == 2 {
            making.remove(&id);
        }
        shared
    }

    /// [`ObjectService::share`] under the object's gate.
    pub(super) fn share_once(&self, id: ObjectId) -> Option<Arc<Segment>> {
        let held = {
            let segments = self.segments();
            if let Some(segment) = segments.get(&id) {
                return Some(segment.clone());
            }
            segments.len()
        };
        let bytes = self.memory().pin(id)?;
        if !worth_sharing(bytes.len() as u64, held) {
            self.memory().unpin(id);
            return None;
        }
        let made = Segment::create(&bytes).map(Arc::new).and_then(|segment| {
            let mapped = segment.map_lazily()?;
            Ok((segment, mapped))
        });
        let outcome = match made {
            Ok((segment, mapped)) => {
                let mut segments = self.segments();
                if let Some(other) = segments.get(&id) {
                    // Another peer's pull made one meanwhile: serve that, drop this one.
                    Some(other.clone())
                } else if let Ok(replaced) = self.memory().replace(id, mapped) {
                    segments.insert(id, segment.clone());
                    // Unmapping a large heap copy takes a while: not on the way to the reply.
                    let old = (bytes, replaced);
                    let _ = std::thread::Builder::new()
                        .name("regatta-free".into())
                        .spawn(move || drop(old));
                    Some(segment)
                } else {
                    // Released while the copy was made: nothing to serve.
                    None
                }
            }
            Err(e) => {
                tracing::warn!(%id, error = %e, "cannot make a shared-memory segment; peers will stream the object");
                None
            }
        };
        self.memory().unpin(id);
        outcome
    }

    /// Remembers the segment that holds an object's bytes, up to [`MAX_SEGMENTS`].
    pub(super) fn keep_segment(&self, id: ObjectId, segment: Arc<Segment>) {
        let mut segments = self.segments();
        if segments.len() < MAX_SEGMENTS {
            segments.insert(id, segment);
        }
    }
}
