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
//! (a thread that lives while the pool holds anything frees the stale ones). It hands one
//! out only when it is at most an eighth larger than asked (the pages past the object are
//! given back to the kernel), and a get that finds none that fits first frees kept ones
//! until they and its new buffer fit under the limit: a process never holds more than the
//! limit in kept buffers, nor kept buffers and a new object together past the larger of
//! the limit and that object. Kept buffers are outside `--object-store-bytes`. A buffer's
//! old bytes are never seen: the transfer fills all of it before the object is handed
//! over, and a failed transfer gives it back unseen.

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

/// Unused buffers, oldest first, and the rule for which to keep. Plain bookkeeping: the
/// buffers it lets go are returned, for the caller to free outside any lock.
#[derive(Debug)]
pub(crate) struct FreeList {
    min: usize,
    limit: usize,
    held: usize,
    /// Each with the time it was given back.
    buffers: Vec<(Instant, Vec<u8>)>,
}

/// What [`FreeList::take`] decided.
#[derive(Debug, Default)]
pub(crate) struct Taken {
    /// A kept buffer that fits, its contents and length as they were.
    pub(crate) buffer: Option<Vec<u8>>,
    /// Kept buffers let go to make room for a new one (when none fit).
    pub(crate) freed: Vec<Vec<u8>>,
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

    /// Whether a buffer of this capacity is worth a [`Pooled`] owner.
    pub(crate) fn keeps(&self, capacity: usize) -> bool {
        (self.min..=self.limit).contains(&capacity) && self.limit > 0
    }

    /// The smallest kept buffer that holds `len` bytes with at most an eighth to spare; when
    /// none does, the oldest kept buffers to free so that the rest and a new buffer of
    /// `len` fit under the limit.
    pub(crate) fn take(&mut self, len: usize) -> Taken {
        if len < self.min {
            return Taken::default();
        }
        let most = len.saturating_add(len / 8);
        let fitting = self
            .buffers
            .iter()
            .enumerate()
            .filter(|(_, (_, b))| (len..=most).contains(&b.capacity()))
            .min_by_key(|(_, (_, b))| b.capacity())
            .map(|(at, _)| at);
        if let Some(at) = fitting {
            let (_, buffer) = self.buffers.remove(at);
            self.held -= buffer.capacity();
            return Taken {
                buffer: Some(buffer),
                freed: Vec::new(),
            };
        }
        let mut freed = Vec::new();
        while !self.buffers.is_empty() && self.held.saturating_add(len) > self.limit {
            let (_, oldest) = self.buffers.remove(0);
            self.held -= oldest.capacity();
            freed.push(oldest);
        }
        Taken { buffer: None, freed }
    }

    /// Keeps `buffer` for a later transfer if it is large enough and fits under the limit,
    /// letting the oldest kept buffers go to make room. Returns what it let go (`buffer`
    /// itself when it is not kept).
    pub(crate) fn give(&mut self, buffer: Vec<u8>, now: Instant) -> Vec<Vec<u8>> {
        let size = buffer.capacity();
        if size < self.min || size > self.limit {
            return vec![buffer];
        }
        let mut freed = Vec::new();
        while self.held + size > self.limit {
            let (_, oldest) = self.buffers.remove(0);
            self.held -= oldest.capacity();
            freed.push(oldest);
        }
        self.held += size;
        self.buffers.push((now, buffer));
        freed
    }

    /// Lets go of the buffers given back more than `idle` before `now`.
    pub(crate) fn expire(&mut self, now: Instant, idle: Duration) -> Vec<Vec<u8>> {
        let (stale, fresh): (Vec<_>, Vec<_>) = std::mem::take(&mut self.buffers)
            .into_iter()
            .partition(|(since, _)| now.saturating_duration_since(*since) >= idle);
        self.buffers = fresh;
        stale
            .into_iter()
            .map(|(_, buffer)| {
                self.held -= buffer.capacity();
                buffer
            })
            .collect()
    }

    #[cfg(test)]
    fn capacities(&self) -> Vec<usize> {
        self.buffers.iter().map(|(_, b)| b.capacity()).collect()
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

/// Runs `f` on the pool under its lock. Buffers `f` lets go must be returned, not dropped
/// inside: unmapping a large one takes a while.
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
        let (stale, done) = with_pool(|pool| {
            let stale = pool.list.expire(Instant::now(), IDLE_LIMIT);
            pool.trimming = pool.list.held() > 0;
            (stale, !pool.trimming)
        });
        drop(stale);
        if done {
            return;
        }
    }
}

/// A buffer of `len` bytes for a transfer to fill: a kept one when one fits, else a fresh
/// one (zeroed, advised huge pages).
pub(crate) fn take(len: usize) -> Vec<u8> {
    let Taken { buffer, freed } = with_pool(|pool| pool.list.take(len));
    drop(freed);
    match buffer {
        Some(buffer) => fit(buffer, len),
        None => regatta_object_store::receive_buffer(len),
    }
}

/// A kept buffer set to `len` bytes; the whole pages past them are given back to the
/// kernel, so an object never keeps more memory than it reads as.
fn fit(mut buffer: Vec<u8>, len: usize) -> Vec<u8> {
    if buffer.len() < len {
        // Within the capacity: no allocation, at most an eighth written.
        buffer.resize(len, 0);
    } else {
        buffer.truncate(len);
    }
    regatta_object_store::release_spare_pages(&buffer);
    buffer
}

/// Gives a buffer back to the pool: a dropped object's, or one a failed transfer did not
/// hand over.
pub(crate) fn give_back(buffer: Vec<u8>) {
    let (freed, start_trimming) = with_pool(|pool| {
        let freed = pool.list.give(buffer, Instant::now());
        let start = pool.list.held() > 0 && !pool.trimming;
        pool.trimming |= start;
        (freed, start)
    });
    drop(freed);
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
/// is dropped (when the pool would keep a buffer of its size).
pub(crate) fn into_bytes(buffer: Vec<u8>) -> Bytes {
    if !with_pool(|pool| pool.list.keeps(buffer.capacity())) {
        return Bytes::from(buffer);
    }
    Bytes::from_owner(Pooled(buffer))
}

/// Bytes of unused buffers this process keeps now.
pub fn pooled_bytes() -> usize {
    with_pool(|pool| pool.list.held())
}

/// The capacities of the buffers kept now.
#[cfg(test)]
pub(crate) fn pooled_capacities() -> Vec<usize> {
    with_pool(|pool| pool.list.capacities())
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

    fn capacities(freed: &[Vec<u8>]) -> Vec<usize> {
        freed.iter().map(Vec::capacity).collect()
    }

    #[test]
    fn a_given_buffer_comes_back_for_the_same_size() {
        let mut list = FreeList::new(100, 1_000);
        assert!(list.give(filled(200, 200, 7), now()).is_empty());
        assert_eq!(list.held(), 200);
        let again = list.take(200).buffer.expect("kept");
        assert_eq!((again.len(), again.capacity(), again[0]), (200, 200, 7));
        assert_eq!(list.held(), 0);
        assert!(list.take(200).buffer.is_none(), "handed out once");
    }

    #[test]
    fn a_buffer_is_handed_out_only_for_sizes_it_fits_with_an_eighth_to_spare() {
        let mut list = FreeList::new(100, 10_000);
        list.give(filled(900, 900, 1), now());
        assert!(list.take(901).buffer.is_none(), "too small");
        assert!(list.take(799).buffer.is_none(), "more than an eighth too large");
        let taken = list.take(800).buffer.expect("900 is 800 and an eighth");
        assert_eq!(taken.capacity(), 900);
        let fitted = fit(taken, 800);
        assert_eq!((fitted.len(), fitted.capacity()), (800, 900));
        // A shorter buffer of the same allocation grows back within its capacity.
        list.give(fitted, now());
        let grown = fit(list.take(900).buffer.expect("fits"), 900);
        assert_eq!((grown.len(), grown.capacity()), (900, 900));
    }

    #[test]
    fn the_smallest_fitting_buffer_is_taken() {
        let mut list = FreeList::new(100, 10_000);
        list.give(filled(1_100, 1_100, 1), now());
        list.give(filled(1_000, 1_000, 2), now());
        list.give(filled(1_050, 1_050, 3), now());
        assert_eq!(list.take(1_000).buffer.expect("fits").capacity(), 1_000);
        assert_eq!(list.take(1_000).buffer.expect("fits").capacity(), 1_050);
        assert_eq!(list.take(1_000).buffer.expect("fits").capacity(), 1_100);
    }

    #[test]
    fn small_and_oversized_buffers_are_not_kept_and_the_oldest_make_room() {
        let mut list = FreeList::new(100, 1_000);
        assert_eq!(capacities(&list.give(filled(99, 99, 1), now())), [99]);
        assert_eq!(capacities(&list.give(filled(1_001, 1_001, 1), now())), [1_001]);
        assert_eq!(list.held(), 0);
        assert!(list.take(50).buffer.is_none(), "below the minimum nothing is pooled");
        list.give(filled(400, 400, 1), now());
        list.give(filled(500, 500, 2), now());
        assert_eq!(
            capacities(&list.give(filled(300, 300, 3), now())),
            [400],
            "the oldest made room"
        );
        assert_eq!(list.held(), 800);
        assert_eq!(list.take(500).buffer.expect("kept")[0], 2);
        assert!(!list.keeps(99) && list.keeps(100) && list.keeps(1_000) && !list.keeps(1_001));
    }

    #[test]
    fn a_get_that_finds_no_fitting_buffer_frees_kept_ones_until_it_fits_under_the_limit() {
        let mut list = FreeList::new(100, 1_000);
        list.give(filled(300, 300, 1), now());
        list.give(filled(400, 400, 2), now());
        // 700 kept and a new 200: under the limit, nothing freed.
        let taken = list.take(200);
        assert!(taken.buffer.is_none() && taken.freed.is_empty());
        // A new 500: the oldest (300) goes, 400 + 500 fit.
        assert_eq!(capacities(&list.take(500).freed), [300]);
        assert_eq!(list.held(), 400);
        // An object over the limit: every kept buffer goes.
        assert_eq!(capacities(&list.take(2_000).freed), [400]);
        assert_eq!(list.held(), 0);
    }

    #[test]
    fn buffers_unused_past_the_idle_limit_are_let_go() {
        let mut list = FreeList::new(100, 10_000);
        let start = Instant::now();
        list.give(filled(200, 200, 1), start);
        list.give(filled(300, 300, 2), start + Duration::from_secs(20));
        assert!(list.expire(start + Duration::from_secs(29), IDLE_LIMIT).is_empty());
        assert_eq!(list.held(), 500);
        assert_eq!(
            capacities(&list.expire(start + Duration::from_secs(30), IDLE_LIMIT)),
            [200]
        );
        assert_eq!(list.held(), 300);
        assert!(list.take(200).buffer.is_none());
        assert_eq!(
            capacities(&list.expire(start + Duration::from_secs(60), IDLE_LIMIT)),
            [300]
        );
        assert_eq!(list.held(), 0);
    }

    #[test]
    fn a_limit_of_zero_keeps_nothing() {
        let mut list = FreeList::new(0, 0);
        assert_eq!(list.give(filled(10, 10, 1), now()).len(), 1);
        assert_eq!(list.held(), 0);
        assert!(!list.keeps(10) && !list.keeps(0));
    }

    #[test]
    fn dropped_object_bytes_return_their_buffer_to_the_pool() {
        // An odd size, more than an eighth away from the one transfer test that pools.
        let len = MIN_POOLED + 4096 * 3;
        let buffer = take(len);
        assert_eq!(buffer.capacity(), len);
        let bytes = into_bytes(buffer);
        let slice = bytes.slice(10..20);
        drop(bytes);
        assert!(!pooled_capacities().contains(&len), "a slice still holds the buffer");
        drop(slice);
        assert!(
            pooled_capacities().contains(&len),
            "given back when the last slice went"
        );
        let again = take(len);
        assert!(!pooled_capacities().contains(&len), "handed out again");
        assert_eq!((again.len(), again.capacity()), (len, len));
        give_back(again);
        assert!(pooled_capacities().contains(&len));
    }
}
