//! Buffers for objects received over the network, kept for the next transfer once the
//! object they held is dropped.
//!
//! A fresh buffer costs the receiving core the kernel's zeroing of every page it touches
//! (and, on a VM, the host backing guest memory touched for the first time): in a profile
//! of a 1 GB get that was 37% of all samples, in series with TLS (docs/NOTES.md). glibc
//! hands every allocation over its mmap threshold back to the kernel when it is freed, so
//! without a pool every get pays it again. Workloads move objects of the same sizes over
//! and over (shards every step, weights to every scorer), so a buffer given back is
//! usually the right size for the next one.
//!
//! The pool keeps at most [`DEFAULT_LIMIT`] bytes (or `REGATTA_RECEIVE_POOL_BYTES`) of
//! buffers nothing refers to any more, only large ones, for at most [`IDLE_LIMIT`] each
//! (a thread that lives while the pool holds anything frees the stale ones), and hands
//! one out only when it is at most an eighth larger than asked (a small object never
//! holds a large buffer). A
//! buffer's old bytes are never seen: the transfer fills all of it before the object is
//! handed over, and a failed transfer gives it back unseen.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;

/// Buffers smaller than this are not kept: glibc serves them from its heap (or they are
/// cheap to fault in), and only large ones cost a page allocation per transfer.
pub(crate) const MIN_POOLED: usize = 32 << 20;

/// How many bytes of unused buffers a process keeps by default.
pub(crate) const DEFAULT_LIMIT: usize = 1 << 30;

/// How long an unused buffer is kept: a process that stopped receiving large objects
/// gives the memory back soon after.
pub(crate) const IDLE_LIMIT: Duration = Duration::from_secs(30);

/// Environment variable: how many bytes of unused receive buffers a process may keep (0
/// keeps none).
pub const RECEIVE_POOL_ENV: &str = "REGATTA_RECEIVE_POOL_BYTES";

/// Unused buffers, oldest first, and the rule for which to keep. Plain bookkeeping.
#[derive(Debug)]
pub(crate) struct FreeList {
    min: usize,
    limit: usize,
    held: usize,
    /// Each with the time it was given back.
    buffers: Vec<(Instant, Vec<u8>)>,
}

impl FreeList {
    /// A list keeping buffers of at least `min` bytes, at most `limit` bytes in all.
    pub(crate) fn new(min: usize, limit: usize) -> Self {
        Self {
            min,
            limit,
            held: 0,
            buffers: Vec::new(),
        }
    }

    /// Bytes of buffers held.
    pub(crate) fn held(&self) -> usize {
        self.held
    }

    /// The smallest kept buffer that holds `len` bytes with at most an eighth to spare,
    /// its length set to `len` (its contents are whatever it last held).
    pub(crate) fn take(&mut self, len: usize) -> Option<Vec<u8>> {
        if len < self.min {
            return None;
        }
        let most = len.saturating_add(len / 8);
        let at = self
            .buffers
            .iter()
            .enumerate()
            .filter(|(_, (_, b))| (len..=most).contains(&b.capacity()))
            .min_by_key(|(_, (_, b))| b.capacity())
            .map(|(at, _)| at)?;
        let (_, mut buffer) = self.buffers.remove(at);
        self.held -= buffer.capacity();
        if buffer.len() < len {
            // Within the capacity: no allocation, at most an eighth written.
            buffer.resize(len, 0);
        } else {
            buffer.truncate(len);
        }
        Some(buffer)
    }

    /// Keeps `buffer` for a later transfer if it is large enough and fits under the limit,
    /// dropping the oldest kept buffers to make room; otherwise drops it.
    pub(crate) fn give(&mut self, buffer: Vec<u8>, now: Instant) {
        let size = buffer.capacity();
        if size < self.min || size > self.limit {
            return;
        }
        while self.held + size > self.limit {
            let (_, oldest) = self.buffers.remove(0);
            self.held -= oldest.capacity();
        }
        self.held += size;
        self.buffers.push((now, buffer));
    }

    /// Drops the buffers given back more than `idle` before `now`.
    pub(crate) fn expire(&mut self, now: Instant, idle: Duration) {
        let held = &mut self.held;
        self.buffers.retain(|(since, buffer)| {
            let keep = now.saturating_duration_since(*since) < idle;
            if !keep {
                *held -= buffer.capacity();
            }
            keep
        });
    }
}

fn limit_from_env() -> usize {
    match std::env::var(RECEIVE_POOL_ENV) {
        Err(_) => DEFAULT_LIMIT,
        Ok(raw) => raw.trim().parse().unwrap_or_else(|_| {
            tracing::warn!(
                value = %raw,
                default = DEFAULT_LIMIT,
                "{RECEIVE_POOL_ENV} is not a number of bytes; using the default"
            );
            DEFAULT_LIMIT
        }),
    }
}

struct Pool {
    list: FreeList,
    /// Whether the thread freeing stale buffers runs.
    trimming: bool,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

fn with_pool<T>(f: impl FnOnce(&mut Pool) -> T) -> T {
    let mut pool = POOL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    f(pool.get_or_insert_with(|| Pool {
        list: FreeList::new(MIN_POOLED, limit_from_env()),
        trimming: false,
    }))
}

/// Frees stale buffers every few seconds while the pool holds any, then ends.
fn trim() {
    loop {
        std::thread::sleep(IDLE_LIMIT / 6);
        let done = with_pool(|pool| {
            pool.list.expire(Instant::now(), IDLE_LIMIT);
            pool.trimming = pool.list.held() > 0;
            !pool.trimming
        });
        if done {
            return;
        }
    }
}

/// A buffer of `len` bytes for a transfer to fill: a kept one when one fits, else a fresh
/// one (zeroed, advised huge pages).
pub(crate) fn take(len: usize) -> Vec<u8> {
    with_pool(|pool| pool.list.take(len)).unwrap_or_else(|| crate::shm::receive_buffer(len))
}

/// Gives back a buffer a failed transfer did not hand over.
pub(crate) fn give_back(buffer: Vec<u8>) {
    let start_trimming = with_pool(|pool| {
        pool.list.give(buffer, Instant::now());
        let start = pool.list.held() > 0 && !pool.trimming;
        pool.trimming |= start;
        start
    });
    if start_trimming {
        let started = std::thread::Builder::new()
            .name("regatta-receive-pool".into())
            .spawn(trim);
        if let Err(e) = started {
            // Without the thread stale buffers stay until the limit pushes them out.
            tracing::warn!(error = %e, "could not start the receive pool's trimming thread");
            with_pool(|pool| pool.trimming = false);
        }
    }
}

/// The object's bytes, giving the buffer back to the pool when the last reference to them
/// is dropped.
pub(crate) fn into_bytes(buffer: Vec<u8>) -> Bytes {
    if buffer.capacity() < MIN_POOLED {
        return Bytes::from(buffer);
    }
    Bytes::from_owner(Pooled(buffer))
}

/// Bytes of unused buffers this process keeps now.
pub fn pooled_bytes() -> usize {
    with_pool(|pool| pool.list.held())
}

/// Owns a received object's buffer; gives it back when dropped.
struct Pooled(Vec<u8>);

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        give_back(std::mem::take(&mut self.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> Instant {
        Instant::now()
    }

    fn filled(len: usize, capacity: usize, byte: u8) -> Vec<u8> {
        let mut buffer = Vec::with_capacity(capacity);
        buffer.resize(len, byte);
        buffer
    }

    #[test]
    fn a_given_buffer_comes_back_for_the_same_size_without_a_new_allocation() {
        let mut list = FreeList::new(100, 1_000);
        let buffer = filled(200, 200, 7);
        let address = buffer.as_ptr();
        list.give(buffer, now());
        assert_eq!(list.held(), 200);
        let again = list.take(200).expect("kept");
        assert_eq!(again.as_ptr(), address, "the same allocation");
        assert_eq!(again.len(), 200);
        assert_eq!(list.held(), 0);
        assert!(list.take(200).is_none(), "handed out once");
    }

    #[test]
    fn a_buffer_is_handed_out_only_for_sizes_it_fits_with_an_eighth_to_spare() {
        let mut list = FreeList::new(100, 10_000);
        list.give(filled(900, 900, 1), now());
        assert!(list.take(901).is_none(), "too small");
        assert!(list.take(799).is_none(), "more than an eighth too large");
        let taken = list.take(800).expect("900 is 800 and an eighth");
        assert_eq!(taken.len(), 800);
        // A shorter buffer of the same allocation grows back within its capacity.
        list.give(taken, now());
        let grown = list.take(900).expect("fits");
        assert_eq!((grown.len(), grown.capacity()), (900, 900));
    }

    #[test]
    fn the_smallest_fitting_buffer_is_taken() {
        let mut list = FreeList::new(100, 10_000);
        list.give(filled(1_100, 1_100, 1), now());
        list.give(filled(1_000, 1_000, 2), now());
        list.give(filled(1_050, 1_050, 3), now());
        assert_eq!(list.take(1_000).expect("fits").capacity(), 1_000);
        assert_eq!(list.take(1_000).expect("fits").capacity(), 1_050);
        assert_eq!(list.take(1_000).expect("fits").capacity(), 1_100);
    }

    #[test]
    fn small_and_oversized_buffers_are_not_kept_and_the_oldest_make_room() {
        let mut list = FreeList::new(100, 1_000);
        list.give(filled(99, 99, 1), now());
        list.give(filled(1_001, 1_001, 1), now());
        assert_eq!(list.held(), 0);
        assert!(list.take(50).is_none(), "below the minimum nothing is pooled");
        list.give(filled(400, 400, 1), now());
        list.give(filled(500, 500, 2), now());
        list.give(filled(300, 300, 3), now());
        assert!(list.held() <= 1_000);
        assert_eq!(list.held(), 800, "the oldest (400) made room");
        assert!(list.take(400).is_none());
        assert_eq!(list.take(500).expect("kept")[0], 2);
    }

    #[test]
    fn buffers_unused_past_the_idle_limit_are_dropped() {
        let mut list = FreeList::new(100, 10_000);
        let start = Instant::now();
        list.give(filled(200, 200, 1), start);
        list.give(filled(300, 300, 2), start + Duration::from_secs(20));
        list.expire(start + Duration::from_secs(29), IDLE_LIMIT);
        assert_eq!(list.held(), 500);
        list.expire(start + Duration::from_secs(30), IDLE_LIMIT);
        assert_eq!(list.held(), 300, "the first one went");
        assert!(list.take(200).is_none());
        list.expire(start + Duration::from_secs(60), IDLE_LIMIT);
        assert_eq!(list.held(), 0);
    }

    #[test]
    fn a_limit_of_zero_keeps_nothing() {
        let mut list = FreeList::new(0, 0);
        list.give(filled(10, 10, 1), now());
        assert_eq!(list.held(), 0);
    }

    #[test]
    fn dropped_object_bytes_return_their_buffer_to_the_pool() {
        // An odd size no other test receives, so tests running beside this one cannot take
        // its buffer.
        let len = MIN_POOLED + 4096 * 3;
        let buffer = take(len);
        let address = buffer.as_ptr();
        let bytes = into_bytes(buffer);
        let slice = bytes.slice(10..20);
        drop(bytes);
        let meanwhile = take(len);
        assert_ne!(meanwhile.as_ptr(), address, "a slice still holds the buffer");
        drop(meanwhile);
        drop(slice);
        let again = take(len);
        assert_eq!(again.as_ptr(), address, "given back when the last slice went");
        assert_eq!(again.len(), len);
        give_back(again);
    }
}
