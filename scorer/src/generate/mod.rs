//! Generation as the scorer runs it, without tensors: rows with prompts and sampling
//! settings ([`params`]), the continuous batcher over a paged KV cache ([`batcher`]), token
//! choice ([`sample`]), stop strings, and the messages between the scorer actor and its
//! executor. The executor (regatta-torch) runs the model where this module says.

pub mod batcher;
mod blocks;
pub mod openai;
pub mod params;
pub mod sample;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::partition::{row_id, RowError};

pub use batcher::{Batcher, BatcherConfig, Feed, Finish, Work};
pub use params::SamplingParams;
pub use sample::{choose, Choice, RowStream};

/// One chat message of a prompt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, or whatever the model's chat template knows.
    pub role: String,
    /// Its text.
    pub content: String,
}

/// A row's prompt: text as is, or chat messages rendered with the model's chat template
/// (with the generation prompt added).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prompt {
    /// Plain text (`prompt` or `text`).
    Text(String),
    /// Chat `messages`.
    Chat(Vec<ChatMessage>),
}

/// A generation row as read from the input.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptRow {
    /// The row's id.
    pub id: String,
    /// Its prompt.
    pub prompt: Prompt,
    /// Its own `params` object, laid over the run's defaults.
    pub params: Option<Value>,
    /// Set for a line in OpenAI's batch input format: how its answer is written.
    pub openai: Option<openai::OpenAiRow>,
}

/// Parses one JSONL line of a generation input: an `id` and one of `messages` (a list of
/// `{role, content}`), `prompt` or `text`, and optionally `params`; or a line in OpenAI's
/// batch input format (see [`openai`]).
pub fn parse_prompt_row(line: &[u8], offset: u64) -> Result<PromptRow, RowError> {
    let fail = |id: Option<String>, reason: String| RowError { id, offset, reason };
    let value: Value = serde_json::from_slice(line).map_err(|e| fail(None, format!("not valid JSON: {e}")))?;
    if openai::is_openai_row(&value) {
        let (mut row, meta) = openai::parse_openai_row(&value, offset)?;
        row.openai = Some(meta);
        return Ok(row);
    }
    let id = row_id(&value, offset)?;
    let prompt = if let Some(messages) = value.get("messages").filter(|m| !m.is_null()) {
        let messages: Vec<ChatMessage> = serde_json::from_value(messages.clone()).map_err(|e| {
            fail(
                Some(id.clone()),
                format!("`messages` must be a list of {{\"role\", \"content\"}} strings: {e}"),
            )
        })?;
        if messages.is_empty() {
            return Err(fail(Some(id), "`messages` is empty".into()));
        }
        Prompt::Chat(messages)
    } else {
        let field = ["prompt", "text"]
            .into_iter()
            .find_map(|k| value.get(k).map(|v| (k, v)));
        match field {
            Some((_, Value::String(text))) if !text.is_empty() => Prompt::Text(text.clone()),
            Some((name, Value::String(_))) => return Err(fail(Some(id), format!("`{name}` is empty"))),
            Some((name, other)) => return Err(fail(Some(id), format!("`{name}` must be a string, not {other}"))),
            None => return Err(fail(Some(id), "no `prompt`, `text` or `messages` field".into())),
        }
    };
    Ok(PromptRow {
        id,
        prompt,
        params: value.get("params").cloned(),
        openai: None,
    })
}

/// Where generated `text` must end because of a stop string: the byte offset of the
/// earliest occurrence of any of `stops`.
pub fn stop_at(text: &str, stops: &[String]) -> Option<usize> {
    stops.iter().filter_map(|s| text.find(s.as_str())).min()
}

/// How an executor generates: the KV cache's budget and the batch's limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GenerationSetup {
    /// Bytes of keys and values the cache may hold (all layers); `None`: decided where the
    /// executor runs, from the memory it finds free ([`auto_kv_cache_bytes`]).
    pub kv_cache_bytes: Option<u64>,
    /// Sequences decoded together at most.
    pub max_batch: usize,
    /// Prompt tokens prefilled per step (longer prompts take several steps).
    pub prefill_tokens: usize,
    /// Token slots per cache block: the unit of allocation and of prefix sharing. 4 by
    /// default, where vLLM's CUDA kernel wants 16: Regatta's attention reads each key by
    /// its slot (the CPU kernel in place, CUDA by a gather), so small blocks cost only
    /// bookkeeping, and a shared prefix is shared to within 3 tokens instead of 15. On the
    /// benchmark's chat rows (a 24-token system prompt) a batch of 64 computed 1,031
    /// prompt tokens instead of 1,615, and its prefill took 1.6-1.8 s instead of 2.5-2.6 s
    /// (docs/NOTES.md, "Generation speed on the CPU").
    pub block_tokens: usize,
    /// Whether rows share the cache blocks of a common prefix (a chat template's system
    /// prompt, a few-shot header) instead of computing them again.
    pub prefix_caching: bool,
    /// Whether a CUDA device replays each decode step's batch shape as a captured CUDA
    /// graph (eager where no graph library is found).
    pub cuda_graphs: bool,
    /// Whether float32 weights on the CPU are packed once and multiplied by a kernel for
    /// few rows instead of libtorch's `linear` (MKL): Regatta's own column-panel kernel
    /// where the CPU has AVX-512F (with only AVX2, for batches of up to 32 rows), oneDNN's
    /// blocked layout elsewhere. A copy of the
    /// weights more in memory; decode steps 1.3-2x faster than oneDNN, which is 1.2-1.4x
    /// faster than MKL, on the AMD machine kind; results equal up to float32 rounding
    /// (docs/NOTES.md, "Generation speed on the CPU").
    pub packed_weights: bool,
    /// Whether a decode step's attention on the CPU (float32) reads each row's cached keys
    /// and values where they lie, instead of gathering them into a padded batch for
    /// libtorch's SDPA (docs/NOTES.md, "Generation speed on the CPU").
    pub paged_attention: bool,
}

impl Default for GenerationSetup {
    fn default() -> Self {
        Self {
            kv_cache_bytes: None,
            max_batch: 32,
            prefill_tokens: 512,
            block_tokens: 4,
            prefix_caching: true,
            cuda_graphs: true,
            packed_weights: true,
            paged_attention: true,
        }
    }
}

/// The memory an executor finds when it sizes its KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeMemory {
    /// A GPU: its memory in all, what this process holds on it already (the weights), and
    /// what the driver says is free (other processes' share taken), where it answers.
    Device { total: u64, held: u64, free: Option<u64> },
    /// The host: its available memory (`MemAvailable`).
    Host { available: u64 },
}

/// Share of a GPU's memory generation may use in all, weights included (vLLM's
/// `gpu_memory_utilization` default): the rest is headroom for activations and other
/// processes.
pub const DEVICE_MEMORY_SHARE: f64 = 0.9;

/// Share of the host's available memory a CPU executor's cache may take (several actors
/// may share a host, and the cache only grows as rows need it).
pub const HOST_MEMORY_SHARE: f64 = 0.25;

/// The KV cache budget when none is set: on a GPU, [`DEVICE_MEMORY_SHARE`] of its memory
/// less what the process holds already, and never more than the free memory less the
/// same headroom (so other processes on the GPU are left their share); on the CPU,
/// [`HOST_MEMORY_SHARE`] of the available memory. Never below 64 MiB, so a crowded device
/// still generates (or says the budget is too small for a row).
pub fn auto_kv_cache_bytes(memory: FreeMemory) -> u64 {
    let bytes = match memory {
        FreeMemory::Device { total, held, free } => {
            let share = ((total as f64 * DEVICE_MEMORY_SHARE) as u64).saturating_sub(held);
            let headroom = total - (total as f64 * DEVICE_MEMORY_SHARE) as u64;
            free.map_or(share, |free| share.min(free.saturating_sub(headroom)))
        }
        FreeMemory::Host { available } => (available as f64 * HOST_MEMORY_SHARE) as u64,
    };
    bytes.max(64 << 20)
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// One row to generate, with its settings already merged and checked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenRequest {
    /// The row's id (it keys the row's random stream).
    pub id: String,
    /// The prompt.
    pub prompt: Prompt,
    /// How to generate.
    pub params: SamplingParams,
}

/// One row's generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    /// The generated text (up to a stop string, without special tokens).
    pub text: String,
    /// Tokens in the prompt.
    pub prompt_tokens: u64,
    /// Tokens generated (an end-of-sequence token included).
    pub generated_tokens: u64,
    /// `stop`, `length` or `eos`.
    pub finish_reason: String,
    /// Each generated token's log-probability, when asked for.
    pub logprobs: Option<Vec<f64>>,
}

/// The executor's figures while it generates, for metrics.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GenStats {
    /// Sequences running.
    pub running: usize,
    /// Sequences waiting for a batch slot or cache blocks.
    pub waiting: usize,
    /// The batch limit.
    pub max_batch: usize,
    /// Cache blocks in use.
    pub used_blocks: usize,
    /// Cache blocks in all.
    pub blocks: usize,
    /// Tokens generated since the last report.
    pub new_tokens: u64,
    /// Sequences preempted since the generation started (their cache blocks given to
    /// others; recomputed when they joined again).
    #[serde(default)]
    pub preemptions: u64,
    /// Tokens found in cached blocks since the generation started (prefix caching: a shared
    /// prefix, or a preempted row's own blocks; not computed again).
    #[serde(default)]
    pub cached_tokens: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unset_kv_budget_takes_a_share_of_the_memory_left() {
        const GIB: u64 = 1 << 30;
        // An 80 GiB GPU holding 2.2 GiB of weights: 90% of it less the weights.
        let gpu = auto_kv_cache_bytes(FreeMemory::Device {
            total: 80 * GIB,
            held: 2 * GIB,
            free: Some(78 * GIB),
        });
        assert_eq!(gpu, (80.0 * 0.9 * GIB as f64) as u64 - 2 * GIB);
        // Another process holds 40 GiB: the budget leaves it there, and the headroom.
        let shared = auto_kv_cache_bytes(FreeMemory::Device {
            total: 80 * GIB,
            held: 2 * GIB,
            free: Some(38 * GIB),
        });
        assert_eq!(shared, 38 * GIB - (80 * GIB - (80.0 * 0.9 * GIB as f64) as u64));
        assert_eq!(auto_kv_cache_bytes(FreeMemory::Host { available: 20 * GIB }), 5 * GIB);
        // A device already full still gets a floor (rows too long for it are refused).
        let full = FreeMemory::Device {
            total: GIB,
            held: GIB,
            free: None,
        };
        assert_eq!(auto_kv_cache_bytes(full), 64 << 20);
        let meminfo = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20971520 kB\n";
        assert_eq!(mem_available(meminfo), Some(20 * GIB));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn prompt_rows_take_messages_then_prompt_then_text() {
        let row = parse_prompt_row(
            br#"{"id": 1, "messages": [{"role": "user", "content": "hi"}], "params": {"top_k": 3}}"#,
            0,
        )
        .unwrap();
        assert_eq!(
            row.prompt,
            Prompt::Chat(vec![ChatMessage {
                role: "user".into(),
                content: "hi".into()
            }])
        );
        assert_eq!(row.params, Some(serde_json::json!({"top_k": 3})));
        let row = parse_prompt_row(br#"{"id": "a", "prompt": "p", "text": "t"}"#, 0).unwrap();
        assert_eq!(row.prompt, Prompt::Text("p".into()));
        let row = parse_prompt_row(br#"{"id": "a", "text": "t"}"#, 0).unwrap();
        assert_eq!(row.prompt, Prompt::Text("t".into()));
        let cases: [(&[u8], &str); 5] = [
            (br#"{"id": "a"}"#, "no `prompt`, `text` or `messages`"),
            (br#"{"id": "a", "prompt": ""}"#, "`prompt` is empty"),
            (br#"{"id": "a", "messages": []}"#, "`messages` is empty"),
            (br#"{"id": "a", "messages": [{"role": 1}]}"#, "list of"),
            (br#"{"prompt": "x"}"#, "no `id`"),
        ];
        for (line, reason) in cases {
            let error = parse_prompt_row(line, 9).unwrap_err();
            assert!(error.reason.contains(reason), "{error:?}");
            assert_eq!(error.offset, 9);
        }
    }

    #[test]
    fn the_earliest_stop_string_wins() {
        let stops = vec!["END".to_string(), "\n".to_string()];
        assert_eq!(stop_at("one\ntwo END", &stops), Some(3));
        assert_eq!(stop_at("one END\n", &stops), Some(4));
        assert_eq!(stop_at("none", &stops), None);
    }
}
