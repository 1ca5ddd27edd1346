//! Continuous batching over a paged KV cache, as bookkeeping only (no tensors): sequences
//! wait in arrival order, join the running batch when a slot and their cache blocks are
//! free, have their prompts prefilled in chunks under a per-step token budget, then decode
//! one token per step; a finished sequence leaves at once and frees its blocks, so a
//! waiting one joins at the next step without the batch draining.
//!
//! The cache is `blocks` blocks of `block_tokens` token slots (block 0 is a scratch block
//! that padding writes to and no sequence owns). Blocks are taken as tokens arrive, not
//! reserved for a sequence's whole length: a sequence joins when blocks for the tokens it
//! holds are free, and gets another block when its next token starts one. When a running
//! sequence needs a block and none is free, the youngest running sequence is **preempted**
//! (as vLLM does): its blocks are freed and it waits at the front of the queue, to be
//! recomputed from its tokens (prompt and what it generated) when it joins again. So the
//! batch is limited by the cache actually used, and a row is refused only when its whole
//! length could never fit. Slot `block * block_tokens + offset` holds the keys and values of
//! one token of one sequence.
//!
//! With prefix caching ([`BatcherConfig::prefix_caching`], see `blocks.rs`) a joining
//! sequence takes the cached blocks that hold its first tokens and is prefilled from the
//! first token they do not hold (never its last token: its logits are needed). A row whose
//! next block of prompt another running row is computing right now waits for it to be
//! cached (rows of a chat template that arrive together compute the common header once).

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};

use super::blocks::BlockPool;
use crate::error::{Error, Result};

/// The shape of the cache and the batch.
#[derive(Clone, Debug, PartialEq)]
pub struct BatcherConfig {
    /// Token slots per block.
    pub block_tokens: usize,
    /// Blocks sequences may own (the scratch block comes on top).
    pub blocks: usize,
    /// Sequences running at once (the batch limit).
    pub max_running: usize,
    /// Prompt tokens prefilled per step, over all sequences (chunked prefill).
    pub prefill_tokens: usize,
    /// The model's context: a sequence never grows past it.
    pub context: usize,
    /// Token ids that end a sequence.
    pub eos: Vec<i64>,
    /// Whether sequences share the cache blocks of a common prefix.
    pub prefix_caching: bool,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// It produced an end-of-sequence token.
    Eos,
    /// It reached its generation limit or the model's context.
    Length,
    /// Its text reached a stop string.
    Stop,
}

impl Finish {
    /// The name written in outputs (`eos`, `length`, `stop`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Eos => "eos",
            Self::Length => "length",
            Self::Stop => "stop",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
enum State {
    Waiting,
    Running,
    Finished(Finish),
}

#[derive(Clone, Debug)]
struct Sequence {
    tokens: Vec<i64>,
    prompt: usize,
    /// Tokens whose keys and values are in the cache.
    computed: usize,
    /// The length the sequence may reach.
    limit: usize,
    blocks: Vec<usize>,
    /// Content ids of its leading full blocks (prefix caching's chain).
    chain: Vec<u64>,
    /// Tokens found in cached blocks when it last joined, counted once its work runs.
    found: usize,
    /// Chain hashes of the whole blocks of tokens it held when it joined (prefix caching).
    hashes: Vec<u64>,
    state: State,
}

/// Tokens `start..end` of sequence `seq` go through the model this step; when `sample`,
/// the logits of the last one give the sequence's next token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Work {
    /// The sequence.
    pub seq: usize,
    /// First token fed.
    pub start: usize,
    /// One past the last token fed.
    pub end: usize,
    /// Whether the step samples a token for this sequence.
    pub sample: bool,
}

/// What one step runs: single-token decodes (one forward for all of them) and prompt
/// chunks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Sequences decoding their next token.
    pub decode: Vec<Work>,
    /// Prompt chunks being prefilled.
    pub prefill: Vec<Work>,
}

impl Step {
    /// Whether there is nothing to run.
    pub fn is_empty(&self) -> bool {
        self.decode.is_empty() && self.prefill.is_empty()
    }
}

/// What the model is fed for one [`Work`]: token ids, their positions, the cache slots
/// their keys and values are written to, and the slots of every key they attend to
/// (positions `0..end`, in order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Feed {
    /// Token ids fed.
    pub tokens: Vec<i64>,
    /// Their positions.
    pub positions: Vec<i64>,
    /// Where their keys and values go.
    pub write: Vec<i64>,
    /// Where the keys of positions `0..end` are.
    pub read: Vec<i64>,
}

/// Occupancy figures for metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Occupancy {
    /// Sequences running.
    pub running: usize,
    /// Sequences waiting to join.
    pub waiting: usize,
    /// Cache blocks held by running sequences.
    pub used_blocks: usize,
    /// Cache blocks in all.
    pub blocks: usize,
}

/// The continuous batcher.
#[derive(Clone, Debug)]
pub struct Batcher {
    config: BatcherConfig,
    pool: BlockPool,
    sequences: Vec<Sequence>,
    waiting: VecDeque<usize>,
    running: Vec<usize>,
    preemptions: u64,
    cached_tokens: u64,
    /// Chain hashes of blocks running sequences are computing and will register, with how
    /// many are computing each (prefix caching).
    computing: HashMap<u64, usize>,
}

/// What a waiting sequence takes when it joins the batch.
struct Admission {
    /// Cached blocks holding its first tokens, with their content ids.
    found: Vec<(usize, u64)>,
    /// New blocks for the tokens it holds and the next one.
    needed: usize,
    /// Chain hashes of its whole blocks of tokens (prefix caching; empty without).
    hashes: Vec<u64>,
}

impl Batcher {
    /// An empty batcher; sizes of 0 are raised to 1.
    pub fn new(mut config: BatcherConfig) -> Self {
        config.block_tokens = config.block_tokens.max(1);
        config.max_running = config.max_running.max(1);
        config.prefill_tokens = config.prefill_tokens.max(1);
        Self {
            pool: BlockPool::new(config.blocks, config.prefix_caching),
            config,
            sequences: Vec::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions: 0,
            cached_tokens: 0,
            computing: HashMap::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &BatcherConfig {
        &self.config
    }

    /// Queues a prompt to be continued by up to `max_new_tokens`; returns its sequence
    /// number, or why it can never run (empty, as long as the context, or needing more
    /// cache than there is).
    pub fn add(&mut self, prompt: Vec<i64>, max_new_tokens: usize) -> Result<usize> {
        if let Some(refusal) = self.refusal(prompt.len(), max_new_tokens, self.config.blocks) {
            return Err(refusal);
        }
        let limit = self.limit(prompt.len(), max_new_tokens);
        let seq = self.sequences.len();
        self.sequences.push(Sequence {
            prompt: prompt.len(),
            tokens: prompt,
            computed: 0,
            limit,
            blocks: Vec::new(),
            chain: Vec::new(),
            found: 0,
            hashes: Vec::new(),
            state: State::Waiting,
        });
        self.waiting.push_back(seq);
        Ok(seq)
    }

    /// The length a sequence with a prompt of `length` tokens may reach.
    fn limit(&self, length: usize, max_new_tokens: usize) -> usize {
        (length + max_new_tokens.max(1)).min(self.config.context)
    }

    /// Blocks a sequence with a prompt of `length` tokens holds while it runs.
    pub fn blocks_for(&self, length: usize, max_new_tokens: usize) -> usize {
        self.limit(length, max_new_tokens).div_ceil(self.config.block_tokens)
    }

    /// Why a prompt of `length` tokens can never run in a cache of `blocks` blocks (empty,
    /// as long as the context, or needing more blocks); `None` when it can.
    pub fn refusal(&self, length: usize, max_new_tokens: usize, blocks: usize) -> Option<Error> {
        let context = self.config.context;
        if length == 0 {
            return Some(Error::EmptyPrompt);
        }
        if length >= context {
            return Some(Error::PromptFillsContext { length, context });
        }
        let needed = self.blocks_for(length, max_new_tokens);
        (needed > blocks).then(|| Error::CacheTooSmall {
            tokens: self.limit(length, max_new_tokens),
            needed,
            block_tokens: self.config.block_tokens,
            blocks,
        })
    }

    /// Blocks a full batch of the sequences not yet finished would hold at their whole
    /// lengths: the running ones and the next waiting ones up to the batch limit (a cache
    /// grown past that could never be used).
    pub fn blocks_wanted(&self) -> usize {
        let room = self.config.max_running.saturating_sub(self.running.len());
        self.running
            .iter()
            .chain(self.waiting.iter().take(room))
            .map(|&seq| self.sequences[seq].limit.div_ceil(self.config.block_tokens))
            .sum()
    }

    /// Adds blocks up to `blocks` in all (the cache behind them grew); never shrinks.
    pub fn grow(&mut self, blocks: usize) {
        if blocks > self.config.blocks {
            self.pool.grow(blocks);
            self.config.blocks = blocks;
        }
    }

    /// Admits waiting sequences in order while a batch slot and blocks for the tokens they
    /// hold (and the next one) are free (a sequence first takes the cached blocks of its
    /// prefix, with prefix caching), then plans the step: a decode for every running
    /// sequence whose tokens are all in the cache but the newest, and prompt chunks (or a
    /// preempted sequence's recomputation) in admission order within the prefill budget.
    /// Blocks are taken as the planned tokens need them; when none is free, the youngest
    /// running sequence is preempted: its blocks are freed and it waits at the front of
    /// the queue, to be recomputed from its tokens when it joins again.
    pub fn schedule(&mut self) -> Step {
        self.admit();
        self.plan_step()
    }

    /// Admits waiting sequences in order while a batch slot and the blocks each needs are
    /// free (see [`Batcher::admission`]).
    fn admit(&mut self) {
        let mut promised = self.promised_blocks();
        while self.running.len() < self.config.max_running {
            let Some(&seq) = self.waiting.front() else { break };
            let Some(admission) = self.admission(seq, promised) else {
                break;
            };
            promised += admission.needed;
            self.waiting.pop_front();
            self.join(seq, admission);
        }
    }

    /// Blocks the running sequences' pending tokens start: theirs first, since a sequence
    /// admitted on them would only be preempted again in this step.
    fn promised_blocks(&self) -> usize {
        let block_tokens = self.config.block_tokens;
        self.running
            .iter()
            .map(|&seq| {
                let s = &self.sequences[seq];
                s.tokens.len().div_ceil(block_tokens).saturating_sub(s.blocks.len())
            })
            .sum()
    }

    /// What waiting sequence `seq` takes when it joins now, with `promised` blocks spoken
    /// for: the cached blocks of its prefix and new blocks for the tokens it holds (and the
    /// next one). `None`: it cannot join this step, for want of blocks or because a running
    /// sequence is computing its next block of prompt (it joins once that block is cached,
    /// a step or a few later, instead of computing it a second time).
    fn admission(&self, seq: usize, promised: usize) -> Option<Admission> {
        let block_tokens = self.config.block_tokens;
        let s = &self.sequences[seq];
        // Cached blocks hold whole blocks of tokens before the last one (whose logits the
        // sequence needs, so it is always computed).
        let shareable = (s.tokens.len() - 1) / block_tokens;
        let found = self.pool.lookup(&s.tokens, block_tokens, shareable);
        let needed = (s.tokens.len() + 1).min(s.limit).div_ceil(block_tokens) - found.len();
        let revived = found.iter().filter(|&&(block, _)| self.pool.is_idle(block)).count();
        if promised + needed + revived > self.pool.available() {
            return None;
        }
        let hashes = if self.config.prefix_caching {
            chain_hashes(&s.tokens, block_tokens)
        } else {
            Vec::new()
        };
        if self.config.prefix_caching && found.len() < shareable && self.computing.contains_key(&hashes[found.len()]) {
            return None;
        }
        Some(Admission { found, needed, hashes })
    }

    /// Moves `seq` into the running batch with its cached prefix blocks; the blocks it
    /// will compute count as being computed.
    fn join(&mut self, seq: usize, admission: Admission) {
        let Admission { found, hashes, .. } = admission;
        for hash in &hashes[found.len()..] {
            *self.computing.entry(*hash).or_default() += 1;
        }
        let s = &mut self.sequences[seq];
        s.hashes = hashes;
        for &(block, id) in &found {
            self.pool.share(block);
            s.blocks.push(block);
            s.chain.push(id);
        }
        s.computed = found.len() * self.config.block_tokens;
        s.found = s.computed;
        s.state = State::Running;
        self.running.push(seq);
    }

    /// Plans the step over the running sequences in admission order: a decode for each
    /// whose tokens are all in the cache but the newest, and prompt chunks (or a preempted
    /// sequence's recomputation) within the prefill budget, each with the blocks it writes.
    fn plan_step(&mut self) -> Step {
        let mut step = Step::default();
        let mut budget = self.config.prefill_tokens;
        let mut i = 0;
        while i < self.running.len() {
            let Some((work, decoding)) = self.next_work(self.running[i], budget) else {
                i += 1;
                continue;
            };
            if !self.take_blocks(i, work.end) {
                break;
            }
            if decoding {
                step.decode.push(work);
            } else {
                budget -= work.end - work.start;
                step.prefill.push(work);
            }
            i += 1;
        }
        step
    }

    /// The work of running sequence `seq` this step, and whether it is a decode; `None`
    /// when it has a prompt chunk to prefill but no `budget` is left.
    fn next_work(&self, seq: usize, budget: usize) -> Option<(Work, bool)> {
        let s = &self.sequences[seq];
        let pending = s.tokens.len() - s.computed;
        if s.computed >= s.prompt && pending == 1 {
            let work = Work {
                seq,
                start: s.computed,
                end: s.tokens.len(),
                sample: true,
            };
            return Some((work, true));
        }
        if budget == 0 {
            return None;
        }
        let take = pending.min(budget);
        let work = Work {
            seq,
            start: s.computed,
            end: s.computed + take,
            sample: s.computed + take == s.tokens.len(),
        };
        Some((work, false))
    }

    /// Gives the running sequence at `index` blocks for every position up to `end`,
    /// preempting the youngest running sequence while none is free (itself, if it is the
    /// youngest: it then waits too, and this step runs without it). Returns whether the
    /// sequence is still running.
    fn take_blocks(&mut self, index: usize, end: usize) -> bool {
        let seq = self.running[index];
        let needed = end.div_ceil(self.config.block_tokens);
        while self.sequences[seq].blocks.len() < needed {
            if let Some(block) = self.pool.take() {
                self.sequences[seq].blocks.push(block);
                continue;
            }
            let youngest = self.running.len() - 1;
            self.preempt(youngest);
            if youngest == index {
                break;
            }
        }
        index < self.running.len()
    }

    /// Takes the running sequence at `index` out of the batch: its blocks are freed, its
    /// tokens kept to be recomputed, and it waits at the front of the queue.
    fn preempt(&mut self, index: usize) {
        let seq = self.running.remove(index);
        let s = &mut self.sequences[seq];
        for block in s.blocks.drain(..).rev() {
            self.pool.release(block);
        }
        forget_computing(&mut self.computing, &s.hashes[s.chain.len().min(s.hashes.len())..]);
        s.hashes.clear();
        s.chain.clear();
        s.computed = 0;
        s.found = 0;
        s.state = State::Waiting;
        self.waiting.push_front(seq);
        self.preemptions += 1;
    }

    /// Sequences preempted so far (each recomputed once it joined again).
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Tokens found in cached blocks by sequences that joined and ran (a shared prefix, or
    /// a preempted sequence's own blocks): not computed again.
    pub fn cached_tokens(&self) -> u64 {
        self.cached_tokens
    }

    /// The model's inputs for `work`.
    pub fn feed(&self, work: &Work) -> Feed {
        let s = &self.sequences[work.seq];
        let slot = |position: usize| {
            let block = s.blocks[position / self.config.block_tokens];
            (block * self.config.block_tokens + position % self.config.block_tokens) as i64
        };
        Feed {
            tokens: s.tokens[work.start..work.end].to_vec(),
            positions: (work.start..work.end).map(|p| p as i64).collect(),
            write: (work.start..work.end).map(slot).collect(),
            read: (0..work.end).map(slot).collect(),
        }
    }

    /// Records that `work` ran and, when it sampled, the token chosen; returns how the
    /// sequence ended if it did (an end-of-sequence token, its limit or the context).
    pub fn advance(&mut self, work: &Work, token: Option<i64>) -> Option<Finish> {
        let block_tokens = self.config.block_tokens;
        let s = &mut self.sequences[work.seq];
        s.computed = work.end;
        self.cached_tokens += std::mem::take(&mut s.found) as u64;
        // Blocks now full of computed tokens are registered for later sequences to share.
        if self.config.prefix_caching {
            while s.chain.len() < s.computed / block_tokens {
                let j = s.chain.len();
                let tokens = &s.tokens[j * block_tokens..(j + 1) * block_tokens];
                let id = self.pool.register(s.blocks[j], s.chain.last().copied(), tokens);
                s.chain.push(id);
                if let Some(hash) = s.hashes.get(j) {
                    forget_computing(&mut self.computing, std::slice::from_ref(hash));
                }
            }
        }
        let token = token?;
        s.tokens.push(token);
        if self.config.eos.contains(&token) {
            Some(Finish::Eos)
        } else if s.tokens.len() >= s.limit {
            Some(Finish::Length)
        } else {
            None
        }
    }

    /// Ends a running sequence: it leaves the batch and its blocks are free for the next.
    pub fn finish(&mut self, seq: usize, reason: Finish) {
        let s = &mut self.sequences[seq];
        if s.state != State::Running {
            return;
        }
        s.state = State::Finished(reason);
        // Last block first: cached prefixes outlive the tails that followed them.
        for block in s.blocks.drain(..).rev() {
            self.pool.release(block);
        }
        forget_computing(&mut self.computing, &s.hashes[s.chain.len().min(s.hashes.len())..]);
        s.hashes = Vec::new();
        s.chain = Vec::new();
        self.running.retain(|r| *r != seq);
    }

    /// Drops a finished sequence's tokens (a long-lived batcher keeps only a small record
    /// of it); [`Batcher::generated`] is empty for it afterwards.
    pub fn forget(&mut self, seq: usize) {
        let s = &mut self.sequences[seq];
        if matches!(s.state, State::Finished(_)) {
            s.tokens = Vec::new();
            s.prompt = 0;
            s.computed = 0;
        }
    }

    /// Tokens generated so far by `seq`.
    pub fn generated(&self, seq: usize) -> &[i64] {
        let s = &self.sequences[seq];
        &s.tokens[s.prompt..]
    }

    /// How `seq` ended, once it has.
    pub fn finished(&self, seq: usize) -> Option<Finish> {
        match self.sequences[seq].state {
            State::Finished(reason) => Some(reason),
            _ => None,
        }
    }

    /// Whether every sequence has finished.
    pub fn is_done(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Running and waiting sequences and blocks in use.
    pub fn occupancy(&self) -> Occupancy {
        Occupancy {
            running: self.running.len(),
            waiting: self.waiting.len(),
            used_blocks: self.pool.in_use(),
            blocks: self.config.blocks,
        }
    }
}

/// A hash of every whole block of `tokens` with all the tokens before it: equal hashes
/// (short of a collision, which only makes a row wait a step) mean equal prefixes.
fn chain_hashes(tokens: &[i64], block_tokens: usize) -> Vec<u64> {
    let mut hashes = Vec::with_capacity(tokens.len() / block_tokens);
    let mut previous = 0u64;
    for block in tokens.chunks_exact(block_tokens) {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (previous, block).hash(&mut hasher);
        previous = hasher.finish();
        hashes.push(previous);
    }
    hashes
}

/// Drops one count of each of `hashes` from `computing`.
fn forget_computing(computing: &mut HashMap<u64, usize>, hashes: &[u64]) {
    for hash in hashes {
        if let Some(count) = computing.get_mut(hash) {
            *count -= 1;
            if *count == 0 {
                computing.remove(hash);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batcher(blocks: usize, max_running: usize, prefill_tokens: usize) -> Batcher {
        Batcher::new(BatcherConfig {
            block_tokens: 4,
            blocks,
            max_running,
            prefill_tokens,
            context: 64,
            eos: vec![2],
            prefix_caching: false,
        })
    }

    fn caching(blocks: usize, max_running: usize) -> Batcher {
        Batcher::new(BatcherConfig {
            prefix_caching: true,
            ..batcher(blocks, max_running, 100).config
        })
    }

    #[test]
    fn a_later_row_takes_the_cached_blocks_of_a_common_prefix_and_computes_the_rest() {
        let mut b = caching(16, 4);
        // 10 common tokens: two whole blocks of 4 are shareable.
        let header: Vec<i64> = (10..20).collect();
        let first = b.add([header.clone(), vec![30, 31]].concat(), 2).unwrap();
        drive(&mut b, |_, _| 9);
        assert_eq!(b.cached_tokens(), 0);
        let second = b.add([header.clone(), vec![40, 41, 42]].concat(), 2).unwrap();
        let step = b.schedule();
        assert_eq!(
            step.prefill,
            vec![Work {
                seq: second,
                start: 8,
                end: 13,
                sample: true
            }]
        );
        // Counted once the work runs (a row preempted before running skipped nothing).
        assert_eq!(b.cached_tokens(), 0);
        // It reads the first row's blocks for positions 0..8 and writes past them only.
        let feed = b.feed(&step.prefill[0]);
        let shared = &feed.read[..8];
        assert!(feed.write.iter().all(|w| !shared.contains(w)), "{feed:?}");
        assert!(feed.write.iter().all(|w| *w >= 4), "the scratch block is never written");
        b.advance(&step.prefill[0], Some(9));
        assert_eq!(b.cached_tokens(), 8);
        assert_ne!(first, second);
    }

    #[test]
    fn rows_arriving_together_with_a_common_header_compute_it_once() {
        let mut b = caching(32, 8);
        let header: Vec<i64> = (10..22).collect();
        let rows: Vec<usize> = (0..4)
            .map(|i| b.add([header.clone(), vec![40 + i, 50 + i]].concat(), 3).unwrap())
            .collect();
        let first = b.schedule();
        // Only the first computes the header's blocks; the others wait for them.
        assert_eq!(first.prefill.iter().map(|w| w.seq).collect::<Vec<_>>(), vec![rows[0]]);
        assert_eq!(b.occupancy().waiting, 3);
        for work in &first.prefill {
            b.advance(work, Some(9));
        }
        let second = b.schedule();
        let joined: Vec<_> = second.prefill.iter().map(|w| (w.seq, w.start)).collect();
        assert_eq!(joined, vec![(rows[1], 12), (rows[2], 12), (rows[3], 12)]);
        drive(&mut b, |_, _| 9);
        assert_eq!(b.cached_tokens(), 3 * 12);
        for seq in rows {
            assert_eq!(b.generated(seq).len(), 3);
        }
        // Without prefix caching nobody waits.
        let mut plain = batcher(32, 8, 100);
        for i in 0..4 {
            plain.add([header.clone(), vec![40 + i, 50 + i]].concat(), 3).unwrap();
        }
        assert_eq!(plain.schedule().prefill.len(), 4);
    }

    #[test]
    fn rows_sharing_a_header_finish_whole_through_preemption_and_leave_nothing_announced() {
        // 7 blocks of 4: the first row (16 tokens, growing to 24) and the second (its header
        // and one token, growing to 21) cannot both grow: one is preempted, gives its
        // blocks and what it announced up, and both still finish whole.
        let mut b = caching(7, 8);
        let header: Vec<i64> = (1..=12).collect();
        let a = b.add([header.clone(), vec![30, 31, 32, 33]].concat(), 8).unwrap();
        let c = b.add([header.clone(), vec![40]].concat(), 8).unwrap();
        drive(&mut b, |_, _| 9);
        assert_eq!(b.generated(a).len(), 8);
        assert_eq!(b.generated(c).len(), 8);
        assert_eq!(b.occupancy().used_blocks, 0);
        assert!(b.preemptions() > 0);
        assert!(b.computing.is_empty(), "nothing is left announced");
    }

    #[test]
    fn a_prompt_wholly_in_the_cache_still_computes_its_last_token() {
        let mut b = caching(16, 4);
        let prompt: Vec<i64> = (1..=8).collect();
        b.add(prompt.clone(), 1).unwrap();
        drive(&mut b, |_, _| 9);
        let again = b.add(prompt, 1).unwrap();
        let step = b.schedule();
        // Two whole blocks are cached, but only the first is taken: the last token is fed.
        assert_eq!(step.prefill[0].start, 4);
        assert_eq!(step.prefill[0].end, 8);
        assert!(step.prefill[0].sample);
        assert_eq!(b.generated(again).len(), 0);
    }

    #[test]
    fn rows_running_together_share_blocks_and_free_them_only_when_the_last_finishes() {
        let mut b = caching(6, 4);
        let header: Vec<i64> = (1..=8).collect();
        // The first row computes the header; the others join once it is registered.
        let a = b.add([header.clone(), vec![20]].concat(), 6).unwrap();
        let first = b.schedule();
        b.advance(&first.prefill[0], Some(9));
        let c = b.add([header.clone(), vec![21]].concat(), 1).unwrap();
        let step = b.schedule();
        let prefill: Vec<_> = step.prefill.iter().map(|w| (w.seq, w.start)).collect();
        assert_eq!(prefill, vec![(c, 8)]);
        // a: 3 blocks (9 + 1 tokens); c shares 2 and owns 1.
        assert_eq!(b.occupancy().used_blocks, 4);
        for work in step.decode.iter().chain(&step.prefill) {
            let token = work.sample.then_some(9);
            if let Some(reason) = b.advance(work, token) {
                b.finish(work.seq, reason);
            }
        }
        assert_eq!(b.finished(c), Some(Finish::Length));
        assert_eq!(
            b.occupancy().used_blocks,
            3,
            "c's own block is back, the shared ones are a's"
        );
        drive(&mut b, |_, _| 9);
        assert_eq!(b.generated(a).len(), 6);
        assert_eq!(b.occupancy().used_blocks, 0);
    }

    #[test]
    fn cached_blocks_give_way_to_new_rows_when_the_cache_is_full() {
        let mut b = caching(4, 1);
        b.add((1..=8).collect(), 1).unwrap();
        drive(&mut b, |_, _| 9);
        // 4 blocks, 2 cached: a row of 13 tokens + 1 needs all 4, evicting the cached ones.
        let other = b.add((100..113).collect(), 3).unwrap();
        drive(&mut b, |_, _| 9);
        assert_eq!(b.generated(other).len(), 3);
        assert_eq!(b.preemptions(), 0);
        assert_eq!(b.cached_tokens(), 0);
        // The first prompt's blocks were evicted: it is computed in full again.
        b.add((1..=8).collect(), 1).unwrap();
        drive(&mut b, |_, _| 9);
        assert_eq!(b.cached_tokens(), 0);
    }

    #[test]
    fn a_preempted_row_finds_its_own_blocks_again_when_they_are_still_cached() {
        let mut b = caching(5, 4);
        let old = b.add((1..=8).collect(), 8).unwrap();
        let young = b.add((50..54).collect(), 8).unwrap();
        let steps = drive(&mut b, |_, _| 9);
        assert!(b.preemptions() > 0, "{steps:?}");
        assert_eq!(b.generated(old).len(), 8);
        assert_eq!(b.generated(young).len(), 8);
        assert!(b.cached_tokens() > 0, "the preempted row took cached blocks back");
    }

    /// Runs every step, answering each sample with `next(seq, generated so far)`, and
    /// returns the steps taken.
    fn drive(b: &mut Batcher, mut next: impl FnMut(usize, usize) -> i64) -> Vec<Step> {
        let mut steps = Vec::new();
        while !b.is_done() {
            let step = b.schedule();
            assert!(!step.is_empty(), "a step with nothing to run while sequences remain");
            for work in step.decode.iter().chain(&step.prefill) {
                let token = work.sample.then(|| next(work.seq, b.generated(work.seq).len()));
                if let Some(reason) = b.advance(work, token) {
                    b.finish(work.seq, reason);
                }
            }
            steps.push(step);
            assert!(steps.len() < 1000, "no progress");
        }
        steps
    }

    #[test]
    fn a_finished_sequence_makes_room_for_a_waiting_one_at_the_next_step() {
        let mut b = batcher(100, 2, 100);
        let short = b.add(vec![5; 3], 2).unwrap();
        let long = b.add(vec![6; 3], 6).unwrap();
        let late = b.add(vec![7; 3], 2).unwrap();
        let steps = drive(&mut b, |_, _| 9);
        // Step 0 prefills both admitted prompts and samples their first tokens; the short
        // one finishes at step 1; the waiting one joins at step 2 while the long one runs.
        assert_eq!(
            steps[0].prefill.iter().map(|w| w.seq).collect::<Vec<_>>(),
            vec![short, long]
        );
        assert_eq!(steps[1].decode.len(), 2);
        assert_eq!(steps[2].prefill.iter().map(|w| w.seq).collect::<Vec<_>>(), vec![late]);
        assert_eq!(steps[2].decode.iter().map(|w| w.seq).collect::<Vec<_>>(), vec![long]);
        assert_eq!(b.generated(long).len(), 6);
        assert_eq!(b.finished(short), Some(Finish::Length));
        assert_eq!(b.occupancy().used_blocks, 0, "every block is free again");
    }

    #[test]
    fn long_prompts_are_prefilled_in_chunks_within_the_budget() {
        let mut b = batcher(100, 4, 5);
        let long = b.add((10..22).collect(), 1).unwrap();
        let short = b.add(vec![3, 4], 1).unwrap();
        let first = b.schedule();
        assert_eq!(
            first.prefill,
            vec![Work {
                seq: long,
                start: 0,
                end: 5,
                sample: false
            }]
        );
        b.advance(&first.prefill[0], None);
        let second = b.schedule();
        assert_eq!(
            second.prefill[0],
            Work {
                seq: long,
                start: 5,
                end: 10,
                sample: false
            }
        );
        b.advance(&second.prefill[0], None);
        let third = b.schedule();
        // 2 tokens finish the long prompt, 2 more fit for the short one's whole prompt.
        assert_eq!(
            third.prefill,
            vec![
                Work {
                    seq: long,
                    start: 10,
                    end: 12,
                    sample: true
                },
                Work {
                    seq: short,
                    start: 0,
                    end: 2,
                    sample: true
                }
            ]
        );
        let feed = b.feed(&third.prefill[0]);
        assert_eq!(feed.tokens, vec![20, 21]);
        assert_eq!(feed.positions, vec![10, 11]);
        assert_eq!(feed.read.len(), 12);
        assert_eq!(&feed.read[10..], &feed.write[..]);
    }

    #[test]
    fn slots_are_private_to_a_sequence_and_never_the_scratch_block() {
        let mut b = batcher(8, 3, 100);
        for n in [5, 7, 2] {
            b.add(vec![1; n], 3).unwrap();
        }
        let step = b.schedule();
        let mut seen = std::collections::HashSet::new();
        for work in &step.prefill {
            let feed = b.feed(work);
            assert_eq!(feed.read, feed.write, "a whole prompt reads what it writes");
            for slot in feed.write {
                assert!(slot >= 4, "slot {slot} is in the scratch block");
                assert!(seen.insert(slot), "slot {slot} is shared");
            }
        }
    }

    #[test]
    fn a_full_cache_preempts_the_youngest_and_every_sequence_still_finishes_whole() {
        // 4 blocks of 4 tokens; each sequence grows to 3 + 5 = 8 tokens = 2 blocks, so at
        // most two fit at full length, but four can start.
        let mut b = batcher(4, 8, 100);
        let seqs: Vec<usize> = (0..5).map(|_| b.add(vec![1, 1, 1], 5).unwrap()).collect();
        let (mut most_running, mut recomputed) = (0, 0);
        let mut steps = 0;
        while !b.is_done() {
            let step = b.schedule();
            let o = b.occupancy();
            most_running = most_running.max(o.running);
            assert!(o.used_blocks <= o.blocks, "{o:?}");
            for work in step.decode.iter().chain(&step.prefill) {
                let feed = b.feed(work);
                assert_eq!(feed.read.len(), work.end, "a work reads every position before its end");
                if work.start == 0 && work.end > 3 {
                    // A preempted sequence comes back with its generated tokens as input.
                    recomputed += 1;
                    assert_eq!(&feed.read[..], &feed.write[..]);
                }
                let token = work
                    .sample
                    .then(|| 10 + (work.seq * 10 + b.generated(work.seq).len()) as i64);
                if let Some(reason) = b.advance(work, token) {
                    b.finish(work.seq, reason);
                }
            }
            steps += 1;
            assert!(steps < 200, "no progress");
        }
        assert_eq!(
            most_running, 4,
            "four sequences started on what they held, not their whole length"
        );
        assert!(b.preemptions() > 0 && recomputed > 0);
        for seq in seqs {
            let expected: Vec<i64> = (0..5).map(|n| 10 + (seq * 10 + n) as i64).collect();
            assert_eq!(
                b.generated(seq),
                &expected[..],
                "sequence {seq} lost or repeated tokens"
            );
            assert_eq!(b.finished(seq), Some(Finish::Length));
        }
        assert_eq!(b.occupancy().used_blocks, 0);
        assert!(b
            .add(vec![1; 10], 20)
            .unwrap_err()
            .to_string()
            .contains("raise the KV cache budget"));
    }

    #[test]
    fn a_sequence_alone_in_too_small_a_cache_for_company_still_runs() {
        // 3 blocks: the long sequence needs all of them; the short ones are preempted or
        // wait, and everything finishes.
        let mut b = batcher(3, 4, 100);
        let long = b.add(vec![1; 6], 6).unwrap();
        let short: Vec<usize> = (0..3).map(|_| b.add(vec![2; 2], 2).unwrap()).collect();
        drive(&mut b, |_, _| 9);
        assert_eq!(b.generated(long).len(), 6);
        for seq in short {
            assert_eq!(b.generated(seq).len(), 2);
        }
    }

    #[test]
    fn a_grown_cache_admits_what_a_small_one_made_wait_and_keeps_old_blocks() {
        // One block: room for the first sequence's prompt and next token only.
        let mut b = batcher(1, 8, 100);
        let first = b.add(vec![1, 1, 1], 1).unwrap();
        let second = b.add(vec![2, 2, 2], 1).unwrap();
        assert_eq!(b.blocks_wanted(), 2);
        b.schedule();
        assert_eq!((b.occupancy().running, b.occupancy().waiting), (1, 1));
        let held = b
            .feed(&Work {
                seq: first,
                start: 0,
                end: 3,
                sample: true,
            })
            .write;
        b.grow(4);
        b.grow(3); // never shrinks
        assert_eq!(b.config().blocks, 4);
        b.schedule();
        assert_eq!(
            b.occupancy().running,
            2,
            "the waiting sequence joined once blocks were added"
        );
        assert_eq!(
            b.feed(&Work {
                seq: first,
                start: 0,
                end: 3,
                sample: true
            })
            .write,
            held
        );
        let other = b
            .feed(&Work {
                seq: second,
                start: 0,
                end: 3,
                sample: true,
            })
            .write;
        assert!(
            other.iter().all(|slot| *slot >= 8),
            "the new sequence got the new blocks: {other:?}"
        );
        assert!(b
            .refusal(10, 20, 4)
            .unwrap()
            .to_string()
            .contains("the cache holds 4 blocks"));
        assert!(b.refusal(10, 6, 4).is_none());
    }

    #[test]
    fn a_forgotten_sequence_keeps_no_tokens() {
        let mut b = batcher(8, 8, 100);
        let seq = b.add(vec![1; 6], 2).unwrap();
        drive(&mut b, |_, _| 9);
        assert_eq!(b.generated(seq), &[9, 9]);
        b.forget(seq);
        assert!(b.generated(seq).is_empty());
        assert_eq!(b.finished(seq), Some(Finish::Length));
    }

    #[test]
    fn eos_context_and_bad_prompts_end_or_refuse_a_sequence() {
        let mut b = batcher(100, 4, 100);
        let stops = b.add(vec![1, 1], 10).unwrap();
        let capped = b.add(vec![1; 60], 10).unwrap();
        drive(&mut b, |seq, n| if seq == stops && n == 2 { 2 } else { 9 });
        assert_eq!(b.finished(stops), Some(Finish::Eos));
        assert_eq!(b.generated(stops), &[9, 9, 2], "the eos token is part of the output");
        assert_eq!(b.finished(capped), Some(Finish::Length));
        assert_eq!(b.generated(capped).len(), 4, "stopped at the context of 64");
        assert!(b.add(vec![1; 64], 1).unwrap_err().to_string().contains("context is 64"));
        assert!(b.add(Vec::new(), 1).unwrap_err().to_string().contains("no tokens"));
    }
}
