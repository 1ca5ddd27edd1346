//! A generation in progress: rows join at any step, the cache grows with their needs up
//! to the budget, and each step runs the batcher's plan, samples and finishes rows.

use std::collections::HashMap;
use std::time::Instant;

use regatta_scorer::{
    choose, stop_at, Batcher, BatcherConfig, Choice, Feed, Finish, GenStats, RowStream, SamplingParams, Work,
};

use super::fixed_decode::FixedShapes;
use super::pick::{Picked, Want};
use super::{Generator, KvCache, Output, Prepared, RowError, Timings};
use crate::error::{Error, Result};

impl<'a> Generator<'a> {
    /// A generation rows can join at any step ([`Session::add`]) while others run: the
    /// cache grows with the rows' needs up to the budget and is kept between them, so a
    /// stream of rows keeps the batch full.
    pub fn session(&self) -> Result<Session<'_, 'a>> {
        let budget = self.blocks();
        if budget == 0 {
            return Err(Error::Invalid(format!(
                "a KV cache of {} bytes holds no block of {} tokens ({} bytes a token); raise the budget",
                self.kv_cache_bytes,
                self.setup.block_tokens,
                KvCache::bytes_per_token(&self.layout, self.kind)
            )));
        }
        let block_tokens = self.setup.block_tokens.max(1);
        Ok(Session {
            generator: self,
            // The scratch block only: blocks are added as rows need them.
            cache: KvCache::new(&self.layout, block_tokens, self.kind, self.device),
            batcher: Batcher::new(BatcherConfig {
                block_tokens,
                blocks: 0,
                max_running: self.setup.max_batch,
                prefill_tokens: self.setup.prefill_tokens,
                context: self.context,
                eos: self.eos.clone(),
                prefix_caching: self.setup.prefix_caching,
            }),
            budget,
            rows: HashMap::new(),
            timings: Timings::default(),
            reported: Instant::now(),
            new_tokens: 0,
            fixed: FixedShapes::default(),
        })
    }
}

/// A row being generated: its settings and what it produced so far.
struct Live {
    params: SamplingParams,
    stream: RowStream,
    output: Output,
}

/// A generation in progress (see [`Generator::session`]).
pub struct Session<'g, 'a> {
    generator: &'g Generator<'a>,
    cache: KvCache,
    batcher: Batcher,
    /// Blocks the budget buys: the cache never grows past them.
    budget: usize,
    rows: HashMap<usize, Live>,
    timings: Timings,
    reported: Instant,
    new_tokens: u64,
    fixed: FixedShapes,
}

impl Session<'_, '_> {
    /// Queues a row; returns its sequence number, or why it can never run (too long for
    /// the context, or needing more cache than the budget buys). Grows the cache first
    /// when a full batch of the rows not yet finished needs more than it holds (at least
    /// doubling it, so a stream of rows copies the cache a few times, not once per row).
    pub fn add(&mut self, row: Prepared) -> std::result::Result<usize, RowError> {
        let (length, max_new) = (row.prompt.len(), row.params.max_new_tokens);
        if let Some(refusal) = self.batcher.refusal(length, max_new, self.budget) {
            return Err(RowError::Refused(refusal));
        }
        let needed = self.batcher.blocks_for(length, max_new);
        // The new row counts only when it would be in the next full batch.
        let o = self.batcher.occupancy();
        let in_next_batch = o.running + o.waiting < self.batcher.config().max_running;
        self.fit(if in_next_batch { needed } else { 0 }, needed);
        let seq = self
            .batcher
            .add(row.prompt, row.params.max_new_tokens)
            .map_err(RowError::Refused)?;
        self.rows.insert(
            seq,
            Live {
                params: row.params,
                stream: row.stream,
                output: Output {
                    tokens: Vec::new(),
                    finish: Finish::Length,
                    logprobs: Vec::new(),
                    logits: Vec::new(),
                },
            },
        );
        Ok(seq)
    }

    /// Grows the cache (at least doubling it, never past the budget) when a full batch of
    /// the rows not yet finished, plus `extra` blocks, would need more than it holds, or
    /// when it holds fewer than `at_least` blocks (one row's whole length).
    fn fit(&mut self, extra: usize, at_least: usize) {
        let have = self.batcher.config().blocks;
        let wanted = self.batcher.blocks_wanted() + extra;
        if wanted > have || at_least > have {
            let grown = wanted.max(2 * have).min(self.budget).max(at_least);
            if grown > have {
                let block_tokens = self.batcher.config().block_tokens;
                self.cache.grow((grown + 1) * block_tokens);
                self.batcher.grow(grown);
            }
        }
    }

    /// Whether no row is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.batcher.is_done()
    }

    /// Where the time went so far.
    pub fn timings(&self) -> Timings {
        Timings {
            cached_tokens: self.batcher.cached_tokens(),
            graph_steps: self.fixed.steps,
            graphs_captured: self.fixed.captured,
            graphs_off: self.fixed.off.clone(),
            ..self.timings.clone()
        }
    }

    /// Why CUDA graphs stopped being used in this session (decode then runs eagerly).
    pub fn graphs_off(&self) -> Option<&str> {
        self.fixed.off.as_deref()
    }

    /// Runs one step (decodes and prompt chunks) and returns the rows it finished, by
    /// sequence number. `text` decodes generated tokens (for stop strings); `on_stats`
    /// hears progress at the generator's pace.
    pub fn step(
        &mut self,
        text: &dyn Fn(&[i64]) -> String,
        on_stats: &mut dyn FnMut(GenStats),
    ) -> Result<Vec<(usize, Output)>> {
        let g = self.generator;
        // Rows that moved up the queue may be longer than the ones the cache was sized for.
        self.fit(0, 0);
        let step = self.batcher.schedule();
        if step.is_empty() {
            return Err(Error::Invalid(
                "the batcher planned an empty step with sequences left".into(),
            ));
        }
        let mut finished = Vec::new();
        for (decoding, works) in [(true, &step.decode), (false, &step.prefill)] {
            if works.is_empty() {
                continue;
            }
            let started = Instant::now();
            let picked = self.forward(decoding, works)?;
            let seqs: Vec<usize> = works.iter().map(|w| w.seq).collect();
            let sampled = self.choose_sampled(&seqs, &picked)?;
            for ((work, picked), sampled) in works.iter().zip(picked).zip(sampled) {
                self.advance(work, picked, sampled, text)?;
                finished.extend(self.take_finished(work.seq));
            }
            self.record_time(decoding, works, started.elapsed().as_secs_f64());
        }
        if self.reported.elapsed() >= g.stats_every {
            self.report(on_stats);
        }
        Ok(finished)
    }

    /// The forward of a step's decodes (`decoding`: in a fixed shape where the generator
    /// can) or of its prompt chunks, and what each row takes from its last logits.
    fn forward(&mut self, decoding: bool, works: &[Work]) -> Result<Vec<Picked>> {
        let g = self.generator;
        let feeds: Vec<Feed> = works.iter().map(|w| self.batcher.feed(w)).collect();
        let wants = self.wants(works);
        let fixed = if decoding {
            g.fixed_forward(&mut self.fixed, &self.cache, &feeds, &wants)
        } else {
            None
        };
        Ok(match fixed {
            Some(picked) => picked?,
            None => g.forward(&self.cache, &feeds, &wants)?,
        })
    }

    /// What each work needs of its row's last logits: nothing (a prompt chunk before the
    /// last), the greedy token, or the logits to sample from (or to keep).
    fn wants(&self, works: &[Work]) -> Vec<Want> {
        let g = self.generator;
        works
            .iter()
            .map(|w| match self.rows.get(&w.seq) {
                _ if !w.sample => Want::Nothing,
                Some(live) if live.params.temperature <= 0.0 && !g.keep_logits => Want::Greedy {
                    logprob: live.params.logprobs,
                },
                _ => Want::Logits,
            })
            .collect::<Vec<_>>()
    }

    /// Takes a work's choice (`picked` by the forward, or `sampled` from its logits) into
    /// its row and the batcher, finishing the row at the end of its sequence, its length
    /// or a stop string.
    fn advance(
        &mut self,
        work: &Work,
        picked: Picked,
        sampled: Option<Choice>,
        text: &dyn Fn(&[i64]) -> String,
    ) -> Result<()> {
        let g = self.generator;
        let live = self
            .rows
            .get_mut(&work.seq)
            .ok_or_else(|| Error::Invalid("a running sequence has no row".into()))?;
        let choice = match picked {
            Picked::Nothing => None,
            Picked::Token { token, logprob } => Some(Choice { token, logprob }),
            Picked::Logits(logits) => {
                if g.keep_logits {
                    live.output.logits.push(logits);
                }
                sampled
            }
        };
        if work.sample != choice.is_some() {
            return Err(Error::Invalid("a sampled row's choice is missing".into()));
        }
        let token = choice.map(|choice| {
            if live.params.logprobs {
                live.output.logprobs.push(choice.logprob);
            }
            self.new_tokens += 1;
            choice.token
        });
        if let Some(reason) = self.batcher.advance(work, token) {
            self.batcher.finish(work.seq, reason);
        } else if token.is_some() && !live.params.stop.is_empty() {
            // Only a stop string ending in the newest token is new, and one of n
            // bytes spans at most n tokens: decode that tail (and a few tokens more,
            // for a character split across tokens), not the whole output each step.
            let longest = live.params.stop.iter().map(String::len).max().unwrap_or(0);
            let generated = self.batcher.generated(work.seq);
            let tail = &generated[generated.len().saturating_sub(longest + 3)..];
            if stop_at(&text(tail), &live.params.stop).is_some() {
                self.batcher.finish(work.seq, Finish::Stop);
            }
        }
        Ok(())
    }

    /// The output of sequence `seq` if the batcher finished it, the row and the sequence
    /// then forgotten.
    fn take_finished(&mut self, seq: usize) -> Option<(usize, Output)> {
        let reason = self.batcher.finished(seq)?;
        let mut live = self.rows.remove(&seq)?;
        let out = &mut live.output;
        out.tokens = self.batcher.generated(seq).to_vec();
        out.finish = reason;
        out.logprobs.truncate(out.tokens.len());
        out.logits.truncate(out.tokens.len());
        self.batcher.forget(seq);
        Some((seq, live.output))
    }

    /// Adds `seconds` spent on `works` to the decode or the prefill figures.
    fn record_time(&mut self, decoding: bool, works: &[Work], seconds: f64) {
        if decoding {
            self.timings.decode_seconds += seconds;
            self.timings.decode_tokens += works.len() as u64;
        } else {
            self.timings.prefill_seconds += seconds;
            self.timings.prefill_tokens += works.iter().map(|w| (w.end - w.start) as u64).sum::<u64>();
        }
    }

    /// The choices of the rows `picked` brought logits for (the others `None`), each with
    /// its own parameters and random stream. Sorting a vocabulary is most of a sampled step
    /// at large batches (milliseconds a row at 32k tokens), so the rows are spread over
    /// the cores; every row's choice is the same as alone.
    fn choose_sampled(&self, seqs: &[usize], picked: &[Picked]) -> Result<Vec<Option<Choice>>> {
        let mut jobs = Vec::new();
        for (i, (seq, picked)) in seqs.iter().zip(picked).enumerate() {
            if let Picked::Logits(logits) = picked {
                let live = self
                    .rows
                    .get(seq)
                    .ok_or_else(|| Error::Invalid("a running sequence has no row".into()))?;
                jobs.push((
                    i,
                    logits.as_slice(),
                    &live.params,
                    live.stream,
                    self.batcher.generated(*seq).len(),
                ));
            }
        }
        let mut out = vec![None; seqs.len()];
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // At least a few rows a thread: a spawn costs tens of microseconds.
        let threads = cores.min(jobs.len().div_ceil(4)).max(1);
        let per_thread = jobs.len().div_ceil(threads).max(1);
        let chosen: Vec<Vec<(usize, Choice)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = jobs
                .chunks(per_thread)
                .map(|part| {
                    scope.spawn(move || {
                        part.iter()
                            .map(|&(i, logits, params, stream, index)| (i, choose(logits, params, stream, index)))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .map_err(|_| Error::Invalid("a sampling thread panicked".into()))
                })
                .collect::<Result<_>>()
        })?;
        for (i, choice) in chosen.into_iter().flatten() {
            out[i] = Some(choice);
        }
        Ok(out)
    }

    /// Tells `on_stats` the figures now (and the tokens since the last report).
    pub fn report(&mut self, on_stats: &mut dyn FnMut(GenStats)) {
        let o = self.batcher.occupancy();
        on_stats(GenStats {
            running: o.running,
            waiting: o.waiting,
            max_batch: self.batcher.config().max_running,
            used_blocks: o.used_blocks,
            blocks: o.blocks,
            new_tokens: self.new_tokens,
            preemptions: self.batcher.preemptions(),
            cached_tokens: self.batcher.cached_tokens(),
        });
        self.new_tokens = 0;
        self.reported = Instant::now();
    }
}
