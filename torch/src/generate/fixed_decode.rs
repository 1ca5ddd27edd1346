//! Decode steps in fixed shapes (rows and keys padded to powers of two), each shape
//! captured once as a CUDA graph and replayed on a GPU, or run as is without capture.

use std::collections::HashMap;

use regatta_scorer::Feed;
use tch::{Device, Kind, Tensor};

use super::pick::{greedy, host_logits, Picked, Want};
use super::{DecodeMode, Generator, KvCache};
use crate::error::{Error, Result};
use crate::graphs::{CudaGraph, Pool};

impl Generator<'_> {
    /// A decode step (every feed one token) run in a fixed shape: rows and keys padded up
    /// to powers of two, inputs copied into that shape's tensors, and on CUDA the shape's
    /// graph replayed (captured at its first use). Greedy rows take the token the graph
    /// chose; sampling rows (and rows whose logits are kept) get their logits from the
    /// graph's output, to choose on the host. `None`: this step cannot run so (graphs off,
    /// or not a decode step).
    pub(super) fn fixed_forward(
        &self,
        fixed: &mut FixedShapes,
        cache: &KvCache,
        feeds: &[Feed],
        wants: &[Want],
    ) -> Option<Result<Vec<Picked>>> {
        if self.decode == DecodeMode::Eager || fixed.off.is_some() {
            return None;
        }
        if feeds.iter().any(|f| f.tokens.len() != 1) || wants.contains(&Want::Nothing) {
            return None;
        }
        let rows = feeds.len().max(1).next_power_of_two() as i64;
        let block_tokens = self.setup.block_tokens.max(1) as i64;
        let longest = feeds.iter().map(|f| f.read.len()).max().unwrap_or(1);
        let keys = longest.max(block_tokens as usize).next_power_of_two() as i64;
        // Graphs hold the cache tensors they were captured with: a grown cache is new ones.
        let slots = cache.keys.first().map_or(0, |k| k.size()[0]);
        if fixed.slots != slots {
            fixed.shapes.clear();
            fixed.pool = None;
            fixed.slots = slots;
        }
        let host = pack_inputs(feeds, rows, keys, block_tokens);
        let (out, logits) = match self.run_fixed(fixed, cache, &host, rows, keys) {
            Ok(out) => out,
            Err(Error::CudaGraph(reason)) => {
                // Eager from here on: slower, not wrong.
                eprintln!("regatta: CUDA graphs off, decoding eagerly: {reason}");
                fixed.off = Some(reason);
                fixed.shapes.clear();
                return None;
            }
            Err(e) => return Some(Err(e)),
        };
        fixed.steps += 1;
        Some(picked_from_fixed(wants, &out, &logits, rows as usize))
    }

    /// Runs the `(rows, keys)` shape on the packed inputs `host`: replays its graph, or
    /// (first use) makes the shape, capturing its graph on CUDA, whose eager run does this
    /// step's work. Returns each row's greedy token then its log-probability (`[2 * rows]`,
    /// on the host) and the logits `[rows, vocab]`.
    fn run_fixed(
        &self,
        fixed: &mut FixedShapes,
        cache: &KvCache,
        host: &Tensor,
        rows: i64,
        keys: i64,
    ) -> Result<(Vec<f64>, Tensor)> {
        let (r, k) = (rows as usize, keys as usize);
        let shape = match fixed.shapes.entry((rows, keys)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let inputs = Tensor::zeros([(4 * r + r * k) as i64], (Kind::Int64, self.device));
                let mut shape = FixedShape {
                    inputs,
                    output: None,
                    graph: None,
                };
                // The capture's eager run does this step's work: it needs the inputs.
                shape.inputs.copy_(host);
                if let DecodeMode::Graphs(ordinal) = self.decode {
                    let (graph, pool, output) = CudaGraph::capture(ordinal, fixed.pool, &mut || {
                        Ok(self.fixed_step(cache, &shape.inputs, rows, keys))
                    })?;
                    fixed.pool = Some(pool);
                    fixed.captured += 1;
                    shape.graph = Some(graph);
                    shape.output = Some(output);
                }
                e.insert(shape)
            }
        };
        shape.inputs.copy_(host);
        let (chosen, logits) = match &shape.graph {
            Some(graph) => {
                graph.replay()?;
                let (chosen, logits) = shape
                    .output
                    .as_ref()
                    .ok_or_else(|| Error::CudaGraph("a captured graph has no output".into()))?;
                (chosen.shallow_clone(), logits.shallow_clone())
            }
            None => self.fixed_step(cache, &shape.inputs, rows, keys),
        };
        Ok((Vec::<f64>::try_from(chosen.to_device(Device::Cpu))?, logits))
    }

    /// One fixed-shape decode step from the packed `inputs` (see [`Self::fixed_forward`]):
    /// returns `[2 * rows]` f64, each row's greedy token then its log-probability, and the
    /// logits `[rows, vocab]` they were chosen from.
    fn fixed_step(&self, cache: &KvCache, inputs: &Tensor, rows: i64, keys: i64) -> (Tensor, Tensor) {
        let part = |i: i64| inputs.narrow(0, i * rows, rows);
        let tokens = part(0).view([rows, 1]);
        let positions = part(1).view([rows, 1]);
        let read = inputs.narrow(0, 4 * rows, rows * keys).view([rows, keys]);
        let logits = self.logits(cache, &tokens, &positions, &part(3), &part(2), &read, None);
        let (tokens, logprobs) = greedy(&logits);
        (Tensor::cat(&[tokens.to_kind(Kind::Double), logprobs], 0), logits)
    }
}

/// The fixed decode shapes a session has run, by (rows, keys).
#[derive(Default)]
pub(super) struct FixedShapes {
    shapes: HashMap<(i64, i64), FixedShape>,
    /// The memory pool the graphs share.
    pool: Option<Pool>,
    /// Cache slots when the shapes were made (a grown cache drops them).
    slots: i64,
    /// Why graphs were turned off (a capture failed, or no library).
    pub(super) off: Option<String>,
    /// Steps run in a fixed shape.
    pub(super) steps: u64,
    /// Graphs captured.
    pub(super) captured: u64,
}

/// One fixed decode shape: its input tensor, and on CUDA its graph and the output the
/// graph writes.
struct FixedShape {
    inputs: Tensor,
    /// The chosen tokens and log-probabilities, and the logits.
    output: Option<(Tensor, Tensor)>,
    graph: Option<CudaGraph>,
}

/// A decode step's inputs as one host buffer, one copy to the device: tokens, positions,
/// write slots, lengths (each `[rows]`), then the read slots `[rows, keys]`.
fn pack_inputs(feeds: &[Feed], rows: i64, keys: i64, block_tokens: i64) -> Tensor {
    let (r, k) = (rows as usize, keys as usize);
    let mut host = vec![0i64; 4 * r + r * k];
    for i in 0..r {
        match feeds.get(i) {
            Some(feed) => {
                host[i] = feed.tokens[0];
                host[r + i] = feed.positions[0];
                host[2 * r + i] = feed.write[0];
                host[3 * r + i] = feed.read.len() as i64;
                host[4 * r + i * k..4 * r + i * k + feed.read.len()].copy_from_slice(&feed.read);
            }
            // A padding row: token 0 at position 0, written to a scratch slot, reading
            // scratch slot 0.
            None => {
                host[2 * r + i] = i as i64 % block_tokens;
                host[3 * r + i] = 1;
            }
        }
    }
    Tensor::from_slice(&host)
}

/// What each row wants from a fixed-shape step's output `out` (`[2 * rows]`: greedy
/// tokens, then their log-probabilities) and its `logits`.
fn picked_from_fixed(wants: &[Want], out: &[f64], logits: &Tensor, rows: usize) -> Result<Vec<Picked>> {
    let mut picked: Vec<Picked> = wants
        .iter()
        .enumerate()
        .map(|(i, want)| match want {
            Want::Greedy { logprob } => Picked::Token {
                token: out[i] as i64,
                logprob: if *logprob { out[rows + i] } else { 0.0 },
            },
            _ => Picked::Nothing,
        })
        .collect();
    let full: Vec<i64> = (0..wants.len() as i64)
        .filter(|&i| wants[i as usize] == Want::Logits)
        .collect();
    if !full.is_empty() {
        for (&i, row) in full.iter().zip(host_logits(logits, &full)?) {
            picked[i as usize] = Picked::Logits(row);
        }
    }
    Ok(picked)
}
