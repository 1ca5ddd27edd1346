//! The KV cache's blocks as bookkeeping: which are free, how many sequences hold each,
//! and (with prefix caching) which full blocks hold which tokens, so a sequence whose
//! prompt starts with tokens another computed takes those blocks instead of computing
//! them again, as vLLM's automatic prefix caching does.
//!
//! A block is registered once it is full of computed tokens, under its tokens and the
//! content of every block before it (a chain of content ids, so two blocks with the same
//! tokens after different prefixes never meet). A full block is never written again, so
//! sharing needs no copy: a sequence writes only past its shared prefix, into blocks of
//! its own. A registered block nobody holds stays cached, to be taken by the next sequence
//! that starts the same way, until a fresh block is wanted and none is free: then the one
//! released longest ago is evicted (a sequence releases its blocks last first, so a
//! prefix outlives the tails that followed it).

use std::collections::{BTreeMap, HashMap};

/// Content id of "no block before this one".
const ROOT: u64 = 0;

/// A registered block's key: the content id of the block before it and its tokens.
type Key = (u64, Vec<i64>);

/// The cache's blocks `1..=blocks` (block 0 is the scratch block and never handed out).
#[derive(Clone, Debug)]
pub(crate) struct BlockPool {
    caching: bool,
    /// Blocks nobody holds and no content names; popped from the end.
    free: Vec<usize>,
    /// Holders of each block, by block id.
    holders: Vec<u32>,
    /// Each registered block's key and content id, by block id.
    registered: Vec<Option<(Key, u64)>>,
    /// Registered blocks by key: the block and its content id.
    index: HashMap<Key, (usize, u64)>,
    /// Registered blocks nobody holds, by when they were released (oldest first).
    cached: BTreeMap<u64, usize>,
    /// When each block in `cached` was released.
    released_at: Vec<Option<u64>>,
    clock: u64,
    next_id: u64,
}

impl BlockPool {
    /// `blocks` free blocks; `caching` turns prefix caching on.
    pub(crate) fn new(blocks: usize, caching: bool) -> Self {
        let mut pool = Self {
            caching,
            free: Vec::new(),
            holders: vec![0],
            registered: vec![None],
            index: HashMap::new(),
            cached: BTreeMap::new(),
            released_at: vec![None],
            clock: 0,
            next_id: ROOT + 1,
        };
        pool.grow(blocks);
        pool
    }

    /// Blocks in all (the scratch block not counted).
    fn blocks(&self) -> usize {
        self.holders.len() - 1
    }

    /// Adds blocks up to `blocks` in all; the new ones are handed out after the free ones
    /// already there.
    pub(crate) fn grow(&mut self, blocks: usize) {
        let old = self.blocks();
        if blocks <= old {
            return;
        }
        let mut added: Vec<usize> = (old + 1..=blocks).rev().collect();
        added.append(&mut self.free);
        self.free = added;
        self.holders.resize(blocks + 1, 0);
        self.registered.resize(blocks + 1, None);
        self.released_at.resize(blocks + 1, None);
    }

    /// Blocks a sequence could take now: the free ones and the cached ones nobody holds.
    pub(crate) fn available(&self) -> usize {
        self.free.len() + self.cached.len()
    }

    /// Blocks held by sequences.
    pub(crate) fn in_use(&self) -> usize {
        self.blocks() - self.available()
    }

    /// A block for new tokens: a free one, else the cached one released longest ago (its
    /// content forgotten); `None` when every block is held.
    pub(crate) fn take(&mut self) -> Option<usize> {
        let block = match self.free.pop() {
            Some(block) => block,
            None => {
                let (_, block) = self.cached.pop_first()?;
                self.released_at[block] = None;
                if let Some((key, _)) = self.registered[block].take() {
                    self.index.remove(&key);
                }
                block
            }
        };
        self.holders[block] = 1;
        Some(block)
    }

    /// A holder lets `block` go: with no holder left it is free again, or cached while
    /// its content is registered.
    pub(crate) fn release(&mut self, block: usize) {
        let holders = &mut self.holders[block];
        *holders = holders.saturating_sub(1);
        if *holders > 0 {
            return;
        }
        if self.registered[block].is_some() {
            self.clock += 1;
            self.cached.insert(self.clock, block);
            self.released_at[block] = Some(self.clock);
        } else {
            self.free.push(block);
        }
    }

    /// The registered blocks holding `tokens` from the start, a block at a time for at
    /// most `blocks` blocks: each block and its content id, up to the first block not
    /// cached. Takes nothing.
    pub(crate) fn lookup(&self, tokens: &[i64], block_tokens: usize, blocks: usize) -> Vec<(usize, u64)> {
        if !self.caching {
            return Vec::new();
        }
        let mut found = Vec::new();
        let mut parent = ROOT;
        for chunk in tokens.chunks_exact(block_tokens).take(blocks) {
            // The key is built to look it up: a block's tokens are few (16 by default).
            match self.index.get(&(parent, chunk.to_vec())) {
                Some(&(block, id)) => {
                    found.push((block, id));
                    parent = id;
                }
                None => break,
            }
        }
        found
    }

    /// Whether `block` is cached with no holder (taking it uses up an available block).
    pub(crate) fn is_idle(&self, block: usize) -> bool {
        self.released_at[block].is_some()
    }

    /// One more holder for a registered block found by [`BlockPool::lookup`].
    pub(crate) fn share(&mut self, block: usize) {
        if let Some(at) = self.released_at[block].take() {
            self.cached.remove(&at);
        }
        self.holders[block] += 1;
    }

    /// Registers `block`, now full of `tokens` after the block with content id `parent`
    /// (`None`: it is the first); returns its content id. When another block already holds
    /// that content, this one stays unregistered and the other's id is returned.
    pub(crate) fn register(&mut self, block: usize, parent: Option<u64>, tokens: &[i64]) -> u64 {
        // A block registered already (taken through a lookup) keeps its content and id.
        if let Some((_, id)) = &self.registered[block] {
            return *id;
        }
        let key = (parent.unwrap_or(ROOT), tokens.to_vec());
        if let Some(&(_, id)) = self.index.get(&key) {
            return id;
        }
        let id = self.next_id;
        if self.caching {
            self.next_id += 1;
            self.index.insert(key.clone(), (block, id));
            self.registered[block] = Some((key, id));
        }
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_released_registered_block_stays_cached_until_a_fresh_block_is_wanted() {
        let mut pool = BlockPool::new(2, true);
        let a = pool.take().unwrap();
        let id = pool.register(a, None, &[1, 2]);
        pool.release(a);
        assert_eq!(pool.available(), 2);
        assert_eq!(pool.lookup(&[1, 2, 3], 2, 1), vec![(a, id)]);
        // The free block goes first; then the cached one is evicted and forgotten.
        let b = pool.take().unwrap();
        assert_ne!(a, b);
        assert_eq!(pool.take(), Some(a));
        assert!(pool.lookup(&[1, 2], 2, 1).is_empty());
        assert_eq!(pool.take(), None);
    }

    #[test]
    fn a_block_is_found_only_after_the_same_prefix() {
        let mut pool = BlockPool::new(4, true);
        let (a, b) = (pool.take().unwrap(), pool.take().unwrap());
        let first = pool.register(a, None, &[1, 2]);
        let second = pool.register(b, Some(first), &[3, 4]);
        assert_eq!(pool.lookup(&[1, 2, 3, 4], 2, 2), vec![(a, first), (b, second)]);
        // The same tokens after another first block are not that block.
        assert!(pool.lookup(&[3, 4, 3, 4], 2, 2).is_empty());
        // At most `blocks` blocks, and only whole ones.
        assert_eq!(pool.lookup(&[1, 2, 3, 4], 2, 1).len(), 1);
        assert_eq!(pool.lookup(&[1, 2, 3], 2, 2).len(), 1);
    }

    #[test]
    fn a_shared_block_is_kept_until_its_last_holder_lets_go() {
        let mut pool = BlockPool::new(1, true);
        let a = pool.take().unwrap();
        pool.register(a, None, &[7]);
        pool.share(a);
        pool.release(a);
        assert_eq!(pool.available(), 0, "one holder is left");
        pool.release(a);
        assert!(pool.is_idle(a));
        pool.share(a);
        assert!(!pool.is_idle(a));
        assert_eq!(pool.in_use(), 1);
    }

    #[test]
    fn the_block_released_longest_ago_is_evicted_first() {
        let mut pool = BlockPool::new(2, true);
        let (a, b) = (pool.take().unwrap(), pool.take().unwrap());
        let ia = pool.register(a, None, &[1]);
        pool.register(b, Some(ia), &[2]);
        // Last block first, as a finished sequence releases them.
        pool.release(b);
        pool.release(a);
        assert_eq!(pool.take(), Some(b));
        assert_eq!(pool.lookup(&[1, 2], 1, 2), vec![(a, ia)]);
    }

    #[test]
    fn equal_content_in_a_second_block_keeps_the_first_registration() {
        let mut pool = BlockPool::new(2, true);
        let (a, b) = (pool.take().unwrap(), pool.take().unwrap());
        let ia = pool.register(a, None, &[5, 5]);
        assert_eq!(pool.register(b, None, &[5, 5]), ia);
        pool.release(b);
        assert_eq!(pool.available(), 1);
        assert!(!pool.is_idle(b), "the duplicate is free, not cached");
    }

    #[test]
    fn without_caching_nothing_is_found_or_kept() {
        let mut pool = BlockPool::new(1, false);
        let a = pool.take().unwrap();
        pool.register(a, None, &[1]);
        pool.release(a);
        assert!(pool.lookup(&[1], 1, 1).is_empty());
        assert!(!pool.is_idle(a));
        assert_eq!(pool.take(), Some(a));
    }
}
