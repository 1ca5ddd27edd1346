//! The forwards a step's work becomes: decodes and short prompt chunks packed into one row
//! of tokens (no padding) where attention reads the cache in place, else padded into one
//! `[rows, time]` batch against the cache; logits for each row's last token only.

use regatta_scorer::Feed;
use tch::{Kind, Tensor};

use super::pick::{pick, Picked, Want};
use super::{Generator, KvCache};
use crate::error::Result;
use crate::model::{Batch, KvStep};

impl Generator<'_> {
    /// One forward of `feeds` (padded into `[rows, time]`) against the cache; returns, for
    /// each row, what `wants` asks of its last fed token's logits: nothing, the greedy token
    /// chosen where the logits are (on the GPU only a token and a log-probability cross to
    /// the host, not a vocabulary of floats), or the logits themselves on the CPU.
    pub(super) fn forward(&self, cache: &KvCache, feeds: &[Feed], wants: &[Want]) -> Result<Vec<Picked>> {
        let chunks = feeds.iter().map(|f| f.tokens.len());
        if self.model.attends_packed() && KvStep::packs(self.setup.paged_attention, self.device, self.kind, chunks) {
            return pick(&self.packed_logits(cache, feeds), wants);
        }
        let rows = feeds.len() as i64;
        let time = feeds.iter().map(|f| f.tokens.len()).max().unwrap_or(1) as i64;
        let keys = feeds.iter().map(|f| f.read.len()).max().unwrap_or(1) as i64;
        let block_tokens = self.setup.block_tokens.max(1) as i64;
        let (mut tokens, mut positions, mut write, mut read) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut lengths = Vec::with_capacity(feeds.len());
        let mut last = Vec::with_capacity(feeds.len());
        for (r, feed) in feeds.iter().enumerate() {
            let n = feed.tokens.len() as i64;
            // Padding writes go to the scratch block (slots 0..block_tokens) and reads of
            // padding keys are masked.
            for t in 0..time {
                let real = t < n;
                tokens.push(if real { feed.tokens[t as usize] } else { 0 });
                positions.push(if real { feed.positions[t as usize] } else { 0 });
                write.push(if real { feed.write[t as usize] } else { t % block_tokens });
            }
            read.extend_from_slice(&feed.read);
            read.extend(std::iter::repeat_n(0, keys as usize - feed.read.len()));
            lengths.push(feed.read.len() as i64);
            last.push(r as i64 * time + n - 1);
        }
        let device = self.device;
        let int = |v: &[i64]| Tensor::from_slice(v).to_device(device);
        let tokens = int(&tokens).view([rows, time]);
        let positions = int(&positions).view([rows, time]);
        let last = int(&last);
        let logits = self.logits(
            cache,
            &tokens,
            &positions,
            &int(&lengths),
            &int(&write),
            &int(&read).view([rows, keys]),
            Some(&last),
        );
        pick(&logits, wants)
    }

    /// The logits `[rows, vocab]` of each feed's last token, the feeds' tokens packed into
    /// one `[1, tokens]` forward with no padding (see [`KvStep::offsets`]); only where
    /// [`KvStep::packs`] says so.
    fn packed_logits(&self, cache: &KvCache, feeds: &[Feed]) -> Tensor {
        let (mut tokens, mut positions, mut write, mut read) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let keys = feeds.iter().map(|f| f.read.len()).max().unwrap_or(1);
        let mut offsets = vec![0i64];
        let mut lengths = Vec::with_capacity(feeds.len());
        for feed in feeds {
            tokens.extend_from_slice(&feed.tokens);
            positions.extend_from_slice(&feed.positions);
            write.extend_from_slice(&feed.write);
            read.extend_from_slice(&feed.read);
            read.extend(std::iter::repeat_n(0, keys - feed.read.len()));
            lengths.push(feed.read.len() as i64);
            offsets.push(tokens.len() as i64);
        }
        let last: Vec<i64> = offsets[1..].iter().map(|end| end - 1).collect();
        let int = |v: &[i64]| Tensor::from_slice(v).to_device(self.device);
        let step = KvStep {
            keys: cache.keys.iter().map(Tensor::shallow_clone).collect(),
            values: cache.values.iter().map(Tensor::shallow_clone).collect(),
            write: int(&write),
            read: int(&read).view([feeds.len() as i64, keys as i64]),
            lengths: int(&lengths),
            in_place: true,
            offsets: Some(int(&offsets)),
        };
        let tokens = int(&tokens).view([1, -1]);
        self.blocks_logits(&tokens, &int(&positions).view([1, -1]), None, step, Some(&int(&last)))
    }

    /// The forward of `tokens` `[rows, time]` at `positions` against the cache: their keys
    /// and values written to slots `write` (`[rows * time]`), each row attending to the
    /// slots `read` (`[rows, keys]`) of which its first `lengths` are real. Returns the
    /// logits `[rows, vocab]` of each row's token at flat index `last` (`[rows]`; `None`:
    /// time is 1). Device ops only, no host data: what a CUDA graph captures.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn logits(
        &self,
        cache: &KvCache,
        tokens: &Tensor,
        positions: &Tensor,
        lengths: &Tensor,
        write: &Tensor,
        read: &Tensor,
        last: Option<&Tensor>,
    ) -> Tensor {
        let (rows, time) = tokens.size2().expect("tokens are [rows, time]");
        let keys = read.size()[1];
        let device = tokens.device();
        // Query at position p sees keys 0..=p of its own row (and, with a sliding window,
        // only the last `window` of them); a padding query sees key 0.
        let key_index = Tensor::arange(keys, (Kind::Int64, device)).view([1, 1, 1, keys]);
        let query_position = positions.view([rows, 1, time, 1]);
        let mut mask = key_index
            .le_tensor(&query_position)
            .logical_and(&key_index.lt_tensor(&lengths.view([rows, 1, 1, 1])));
        if let Some(window) = self.layout.sliding_window {
            mask = mask.logical_and(&key_index.gt_tensor(&(&query_position - window as i64)));
        }
        let step = KvStep {
            keys: cache.keys.iter().map(Tensor::shallow_clone).collect(),
            values: cache.values.iter().map(Tensor::shallow_clone).collect(),
            write: write.shallow_clone(),
            read: read.shallow_clone(),
            lengths: lengths.shallow_clone(),
            in_place: self.setup.paged_attention,
            offsets: None,
        };
        self.blocks_logits(tokens, positions, Some(mask), step, last)
    }

    /// The blocks over `tokens` (`[rows, time]`) at `positions`, attending through `kv`
    /// (with `mask` where the step is padded); the logits `[rows, vocab]` of the tokens at
    /// flat indices `last` (`None`: every token, time being 1).
    fn blocks_logits(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        mask: Option<Tensor>,
        kv: KvStep,
        last: Option<&Tensor>,
    ) -> Tensor {
        let mut batch = Batch {
            positions: positions.shallow_clone(),
            mask,
            segments: None,
            derived: Vec::new(),
            kv: Some(kv),
            dropout_seed: None,
            packed: self.packed.clone(),
        };
        self.model.prepare(&mut batch);
        let (rows, time) = tokens.size2().expect("tokens are [rows, time]");
        let last_block = self.params.len() - 1;
        let logits = tch::no_grad(|| {
            let mut hidden = tokens.shallow_clone();
            for (block, params) in self.params.iter().enumerate().take(last_block) {
                hidden = self.model.forward(block, params, &hidden, &batch);
            }
            // Only each row's last token needs logits: the head runs on those alone.
            let width = hidden.size()[2];
            let picked = match last {
                Some(last) => hidden.view([rows * time, width]).index_select(0, last),
                None => hidden.view([rows * time, width]),
            };
            let picked = picked.view([-1, 1, width]);
            self.model
                .forward(last_block, &self.params[last_block], &picked, &batch)
        });
        logits.view([logits.size()[0], -1])
    }
}
