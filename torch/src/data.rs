//! The token dataset as a rank reads it: only its own partitions' byte ranges, through
//! `object_store`. Tokens are bytes by default (token id = byte value); with a Hugging Face
//! `tokenizer.json` the file is split into byte ranges per partition and each range is
//! tokenized by the rank that owns it.

use regatta_trainer::{chunks, DataLayout, BYTE_VOCAB};
use tch::{Kind, Tensor};

use regatta_object_store::Place;

/// How text becomes token ids.
pub enum TextTokenizer {
    /// Every byte is a token.
    Bytes,
    /// A Hugging Face tokenizer.
    Hf(Box<tokenizers::Tokenizer>),
}

impl TextTokenizer {
    /// Loads `tokenizer.json` from a path or URL; an empty spec means bytes.
    pub async fn load(spec: &str) -> Result<Self, String> {
        if spec.is_empty() {
            return Ok(Self::Bytes);
        }
        let (place, name) = Place::file(spec)?;
        let bytes = place.get(&name).await?;
        Self::from_json(&bytes, spec)
    }

    /// A tokenizer from the bytes of a `tokenizer.json`; `what` names it in errors.
    pub fn from_json(bytes: &[u8], what: &str) -> Result<Self, String> {
        let tokenizer = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| format!("{what} is not a valid tokenizer.json: {e}"))?;
        Ok(Self::Hf(Box::new(tokenizer)))
    }

    /// Token ids the model must embed.
    pub fn vocab(&self) -> usize {
        match self {
            Self::Bytes => BYTE_VOCAB,
            Self::Hf(t) => t.get_vocab_size(true),
        }
    }

    /// Token ids of some text (invalid UTF-8 is replaced for a tokenizer).
    pub fn encode(&self, text: &[u8]) -> Result<Vec<i64>, String> {
        match self {
            Self::Bytes => Ok(text.iter().map(|b| i64::from(*b)).collect()),
            Self::Hf(t) => {
                let text = String::from_utf8_lossy(text);
                let encoding = t
                    .encode(text.as_ref(), false)
                    .map_err(|e| format!("cannot tokenize: {e}"))?;
                Ok(encoding.get_ids().iter().map(|id| i64::from(*id)).collect())
            }
        }
    }

    /// Text of some token ids.
    pub fn decode(&self, ids: &[i64]) -> String {
        match self {
            Self::Bytes => {
                let bytes: Vec<u8> = ids.iter().map(|id| (*id).clamp(0, 255) as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Self::Hf(t) => {
                let ids: Vec<u32> = ids.iter().map(|id| (*id).max(0) as u32).collect();
                t.decode(&ids, true).unwrap_or_default()
            }
        }
    }
}

/// The partitions one process trains on (one for a rank; all of them for the
/// single-process reference run).
pub struct RankData {
    context: usize,
    /// Token ids and sequence count of each loaded partition.
    loaded: Vec<(Vec<i64>, usize)>,
}

impl RankData {
    /// Reads partitions `which` of `partitions` from the dataset at `path`.
    pub async fn load(
        path: &str,
        tokenizer: &TextTokenizer,
        context: usize,
        partitions: usize,
        which: &[usize],
    ) -> Result<Self, String> {
        let (place, name) = Place::file(path)?;
        let size = place.size(&name).await?;
        let layout = DataLayout::new(size, context, partitions)?;
        let byte_ranges = chunks(size as usize, partitions.max(1));
        let mut loaded = Vec::with_capacity(which.len());
        for &p in which {
            if p >= partitions {
                return Err(format!("partition {p} of {partitions} does not exist"));
            }
            let (range, sequences) = match tokenizer {
                TextTokenizer::Bytes => (layout.token_range(p), layout.partitions[p].len()),
                TextTokenizer::Hf(_) => {
                    let r = &byte_ranges[p];
                    (r.start as u64..r.end as u64, 0)
                }
            };
            let bytes = place.get_range(&name, range).await?;
            let tokens = tokenizer.encode(&bytes)?;
            let sequences = if sequences > 0 {
                sequences
            } else {
                tokens.len().saturating_sub(1) / context.max(1)
            };
            if sequences == 0 {
                return Err(format!(
                    "partition {p} of {path} holds {} tokens, fewer than one sequence of {}",
                    tokens.len(),
                    context + 1
                ));
            }
            loaded.push((tokens, sequences));
        }
        Ok(Self { context, loaded })
    }

    /// Tokens this process holds.
    pub fn tokens(&self) -> usize {
        self.loaded.iter().map(|(t, _)| t.len()).sum()
    }

    /// Inputs and targets (`[n, context]` token ids) of the batch at `position`: `per_partition`
    /// sequences from each loaded partition, in partition order, wrapping at its end.
    pub fn batch(&self, position: u64, per_partition: usize) -> (Tensor, Tensor) {
        let t = self.context;
        let mut inputs = Vec::with_capacity(self.loaded.len() * per_partition * t);
        let mut targets = Vec::with_capacity(inputs.capacity());
        for (tokens, sequences) in &self.loaded {
            for j in 0..per_partition as u64 {
                let index = ((position + j) % *sequences as u64) as usize;
                let sequence = &tokens[index * t..index * t + t + 1];
                inputs.extend_from_slice(&sequence[..t]);
                targets.extend_from_slice(&sequence[1..]);
            }
        }
        let rows = (inputs.len() / t) as i64;
        let shape = [rows, t as i64];
        (
            Tensor::from_slice(&inputs).view(shape).to_kind(Kind::Int64),
            Tensor::from_slice(&targets).view(shape).to_kind(Kind::Int64),
        )
    }
}
