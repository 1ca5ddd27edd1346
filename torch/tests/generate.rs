#![allow(clippy::unwrap_used)]
//! Generation with the paged KV cache and continuous batching, against `transformers`'
//! own `generate` (greedy, fixtures made by scripts/make-generate-fixtures.py) and against
//! recomputing the whole window for every token: prompts of different lengths join and
//! leave the batch at different steps, long prompts are prefilled in chunks, and a cache
//! too small for every sequence makes some wait.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use regatta_scorer::{Finish, GenStats, GenerationSetup, RowStream, SamplingParams};
use regatta_torch::seeded;
use regatta_torch::{arrange, inference_layout, logits};
use regatta_torch::{tch, Generator, Gpt, HfModel, Model, Output, Prepared, RowError};
use regatta_trainer::ModelConfig;
use tch::{Device, Tensor};

const FIXTURES: [&str; 3] = ["llama", "mistral", "qwen2"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn load(dir: &Path) -> (Box<dyn Model>, Vec<Vec<Tensor>>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let hf = rt.block_on(HfModel::open(dir.to_str().unwrap())).unwrap();
    let model = hf.model().unwrap();
    let stored: HashMap<String, Tensor> = model
        .blocks()
        .into_iter()
        .flatten()
        .filter(|spec| spec.tied_to.is_none())
        .map(|spec| {
            let t = rt.block_on(hf.read(&spec)).unwrap();
            (spec.name, t)
        })
        .collect();
    // As the scorer lays them out for the CPU.
    let params = inference_layout(arrange(model.as_ref(), &stored).unwrap(), Device::Cpu);
    (model, params)
}

fn greedy(max_new_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_new_tokens,
        ..SamplingParams::default()
    }
}

/// Seeded nucleus sampling with log-probabilities.
fn sampled(max_new_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_new_tokens,
        temperature: 1.0,
        top_p: 0.9,
        top_k: 50,
        seed: 42,
        logprobs: true,
        ..SamplingParams::default()
    }
}

fn setup(kv_cache_bytes: u64, max_batch: usize, prefill_tokens: usize) -> GenerationSetup {
    GenerationSetup {
        kv_cache_bytes: Some(kv_cache_bytes),
        max_batch,
        prefill_tokens,
        block_tokens: 4,
        ..GenerationSetup::default()
    }
}

/// A generator of `model` on the CPU with a context of 128 and no end-of-sequence token.
fn on_cpu<'a>(model: &'a dyn Model, params: &'a [Vec<Tensor>], setup: GenerationSetup) -> Generator<'a> {
    Generator::new(model, params, setup, 128, Vec::new(), Device::Cpu).unwrap()
}

fn ids(t: &Tensor) -> Vec<i64> {
    Vec::<i64>::try_from(t.to_kind(tch::Kind::Int64)).unwrap()
}

fn run(generator: &Generator, rows: &[Prepared]) -> (Vec<Output>, Vec<GenStats>) {
    let mut stats = Vec::new();
    let outputs = generator
        .run(rows, &|_| String::new(), &mut |s| stats.push(s))
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    (outputs, stats)
}

/// Greedy tokens and their logits by running the whole sequence through the model for
/// every new token (no cache).
fn full_window(model: &dyn Model, params: &[Vec<Tensor>], prompt: &[i64], new: usize) -> (Vec<i64>, Vec<Tensor>) {
    let mut sequence = prompt.to_vec();
    let (mut tokens, mut steps) = (Vec::new(), Vec::new());
    for _ in 0..new {
        let input = Tensor::from_slice(&sequence).view([1, -1]);
        let out = tch::no_grad(|| logits(model, params, &input));
        let last = out.get(0).get(sequence.len() as i64 - 1);
        let next = last.argmax(0, false).int64_value(&[]);
        steps.push(last);
        tokens.push(next);
        sequence.push(next);
    }
    (tokens, steps)
}

fn max_diff(a: &[f32], b: &Tensor) -> f64 {
    (Tensor::from_slice(a) - b).abs().max().double_value(&[])
}

/// Two runs of one row gave the same tokens and log-probabilities within `tolerance`.
fn assert_same_row(what: &str, a: &Output, b: &Output, tolerance: f64) {
    assert_eq!(a.tokens, b.tokens, "{what}: tokens");
    for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
        assert!((x - y).abs() < tolerance, "{what}: logprob {x} vs {y}");
    }
}

#[test]
fn cached_continuous_batching_equals_transformers_generate() {
    tch::set_num_threads(1);
    for name in FIXTURES {
        let (model, params) = load(&fixture(name));
        let expected: HashMap<String, Tensor> = Tensor::read_safetensors(fixture(name).join("generate.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
        let count = expected.keys().filter(|k| k.starts_with("prompt.")).count();
        assert_eq!(count, 4);
        let rows: Vec<Prepared> = (0..count)
            .map(|i| Prepared {
                prompt: ids(&expected[&format!("prompt.{i}")]),
                params: greedy(16),
                stream: RowStream::new(0, &i.to_string()),
            })
            .collect();
        // Two sequences at a time, prompts prefilled 8 tokens a step (the 50-token prompt
        // takes 7 steps while another sequence decodes beside it); with the weights packed
        // for oneDNN (the default on the CPU) and with libtorch's own `linear`, and attention
        // reading the cache in place (the default) and gathering it for SDPA.
        for (packed, paged) in [(true, true), (false, true), (true, false)] {
            let setup = GenerationSetup {
                packed_weights: packed,
                paged_attention: paged,
                ..setup(1 << 20, 2, 8)
            };
            let generator = Generator::new(model.as_ref(), &params, setup, 128, vec![2], Device::Cpu)
                .unwrap()
                .keep_logits()
                .stats_every(std::time::Duration::ZERO);
            let (matrices, bytes) = generator.packed_weights();
            assert_eq!(matrices > 0 && bytes > 0, packed, "{name}: {matrices} matrices packed");
            let (outputs, stats) = run(&generator, &rows);
            assert!(
                stats.iter().any(|s| s.waiting > 0),
                "{name}: no sequence ever waited for a batch slot"
            );
            for (i, out) in outputs.iter().enumerate() {
                assert_eq!(
                    out.tokens,
                    ids(&expected[&format!("tokens.{i}")]),
                    "{name} prompt {i}: tokens (packed {packed}, paged {paged})"
                );
                let scores = &expected[&format!("scores.{i}")];
                for (step, row) in out.logits.iter().enumerate() {
                    let diff = max_diff(row, &scores.get(step as i64));
                    assert!(
                        diff < 1e-4,
                        "{name} prompt {i} token {step} (packed {packed}, paged {paged}): logits differ by {diff}"
                    );
                }
                assert_eq!(out.finish, Finish::Length, "{name} packed {packed} paged {paged}");
            }
        }
    }
}

#[test]
fn sequences_joining_and_leaving_at_different_steps_equal_full_window_recomputation() {
    tch::set_num_threads(1);
    let (model, params) = load(&fixture("llama"));
    let lengths = [5usize, 40, 2, 17, 9, 33];
    let new = [3usize, 12, 30, 1, 25, 5];
    let rows: Vec<Prepared> = lengths
        .iter()
        .zip(new)
        .enumerate()
        .map(|(i, (&n, max_new))| Prepared {
            prompt: (0..n as i64).map(|t| 3 + (t * 37 + i as i64 * 101) % 500).collect(),
            params: greedy(max_new),
            stream: RowStream::new(0, &i.to_string()),
        })
        .collect();
    let bytes_per_token = 2 * 2 * 2 * 16 * 4; // K and V, 2 layers, 2 KV heads of 16 floats
                                              // Room for 56 tokens: the cache, not the batch limit, holds sequences back.
    let budget = 15 * 4 * bytes_per_token;
    let generator = Generator::new(
        model.as_ref(),
        &params,
        setup(budget, 8, 6),
        128,
        Vec::new(),
        Device::Cpu,
    )
    .unwrap()
    .keep_logits()
    .stats_every(std::time::Duration::ZERO);
    let (outputs, stats) = run(&generator, &rows);
    assert!(
        stats.iter().all(|s| s.used_blocks <= s.blocks) && stats.last().unwrap().used_blocks == 0,
        "{stats:?}"
    );
    // The cache (14 blocks of 4 tokens), not the batch limit of 8, held sequences back.
    assert!(stats.iter().any(|s| s.waiting > 0 && s.running < 8), "{stats:?}");
    assert!(stats.iter().map(|s| s.used_blocks).max().unwrap() > 10, "{stats:?}");
    // Blocks are taken as tokens arrive: sequences started on what they held and the
    // youngest gave its blocks up when the cache ran out; recomputed, it still equals the
    // whole-window reference below.
    assert!(
        stats.last().unwrap().preemptions > 0,
        "no sequence was preempted: {stats:?}"
    );
    for (i, out) in outputs.iter().enumerate() {
        let (tokens, steps) = full_window(model.as_ref(), &params, &rows[i].prompt, new[i]);
        assert_eq!(out.tokens, tokens, "row {i}");
        for (step, expected) in steps.iter().enumerate() {
            let diff = max_diff(&out.logits[step], expected);
            assert!(diff < 1e-4, "row {i} token {step}: logits differ by {diff}");
        }
    }
    // One row alone gives the same tokens as in company.
    let (alone, _) = run(&generator, &rows[1..2]);
    assert_eq!(alone[0].tokens, outputs[1].tokens);
}

#[test]
fn the_builtin_gpt_generates_the_same_with_and_without_the_cache() {
    tch::set_num_threads(1);
    let config = ModelConfig {
        layers: 2,
        width: 32,
        heads: 4,
        context: 48,
        ..ModelConfig::default()
    };
    let gpt = Gpt::new(config, 256);
    let params: Vec<Vec<Tensor>> = gpt
        .blocks()
        .iter()
        .map(|block| block.iter().map(|spec| seeded(spec, 9)).collect())
        .collect();
    let prompts: Vec<Vec<i64>> = vec![
        b"hello".iter().map(|b| i64::from(*b)).collect(),
        vec![7; 30],
        vec![1, 2],
    ];
    let rows: Vec<Prepared> = prompts
        .iter()
        .map(|p| Prepared {
            prompt: p.clone(),
            params: greedy(20),
            stream: RowStream::new(0, "x"),
        })
        .collect();
    let generator = Generator::new(&gpt, &params, setup(1 << 20, 2, 7), 48, Vec::new(), Device::Cpu).unwrap();
    let (outputs, _) = run(&generator, &rows);
    for (row, out) in rows.iter().zip(&outputs) {
        // The context of 48 caps the 30-token prompt at 18 new tokens.
        let new = 20.min(48 - row.prompt.len());
        assert_eq!(out.tokens, full_window(&gpt, &params, &row.prompt, new).0);
        assert_eq!(out.finish, Finish::Length);
    }
}

#[test]
fn seeded_sampling_gives_a_row_the_same_text_in_any_company() {
    tch::set_num_threads(1);
    let (model, params) = load(&fixture("qwen2"));
    let sampled = sampled(12);
    let rows: Vec<Prepared> = (0..5)
        .map(|i| Prepared {
            prompt: vec![3 + i, 50, 60 + i],
            params: sampled.clone(),
            stream: RowStream::new(42, &format!("row-{i}")),
        })
        .collect();
    let generator = |batch| {
        Generator::new(
            model.as_ref(),
            &params,
            setup(1 << 20, batch, 64),
            128,
            Vec::new(),
            Device::Cpu,
        )
        .unwrap()
    };
    let (together, _) = run(&generator(5), &rows);
    let (one_at_a_time, _) = run(&generator(1), &rows);
    let reversed: Vec<Prepared> = rows.iter().rev().cloned().collect();
    let (backwards, _) = run(&generator(3), &reversed);
    for i in 0..rows.len() {
        assert_eq!(together[i].tokens, one_at_a_time[i].tokens, "row {i}");
        assert_eq!(together[i].tokens, backwards[rows.len() - 1 - i].tokens, "row {i}");
        assert_eq!(together[i].logprobs.len(), 12);
        assert!(together[i].logprobs.iter().all(|l| *l <= 0.0 && l.is_finite()));
    }
    // Sampling differs from greedy and between rows with different streams.
    let greedy_rows: Vec<Prepared> = rows
        .iter()
        .map(|r| Prepared {
            params: greedy(12),
            ..r.clone()
        })
        .collect();
    let (greedy_out, _) = run(&generator(5), &greedy_rows);
    assert!(
        together.iter().zip(&greedy_out).any(|(s, g)| s.tokens != g.tokens),
        "sampling was greedy"
    );
}

#[test]
fn rows_that_cannot_run_get_a_reason_and_the_others_still_run() {
    let (model, params) = load(&fixture("llama"));
    let generator = on_cpu(model.as_ref(), &params, setup(1 << 20, 4, 64));
    let rows = [vec![5; 128], vec![5; 4]].map(|prompt| Prepared {
        prompt,
        params: greedy(3),
        stream: RowStream::new(0, "r"),
    });
    let results = generator.run(&rows, &|_| String::new(), &mut |_| {}).unwrap();
    let refused = results[0].as_ref().unwrap_err();
    assert!(
        matches!(
            refused,
            RowError::Refused(regatta_scorer::Error::PromptFillsContext { context: 128, .. })
        ),
        "{refused}"
    );
    assert!(refused.to_string().contains("context is 128"), "{refused}");
    assert_eq!(results[1].as_ref().unwrap().tokens.len(), 3);
    let tiny = Generator::new(model.as_ref(), &params, setup(100, 4, 64), 128, Vec::new(), Device::Cpu).unwrap();
    let error = tiny
        .run(&rows[1..], &|_| String::new(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(error.contains("raise the budget"), "{error}");
}

#[test]
fn a_sliding_window_limits_cached_attention_as_it_limits_full_windows() {
    tch::set_num_threads(1);
    // The Mistral fixture's weights under a config whose window (6 keys) is shorter than
    // the prompts: the cached path's mask must drop old keys exactly as the full forward.
    let (_, params) = load(&fixture("mistral"));
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("mistral").join("config.json")).unwrap()).unwrap();
    json["sliding_window"] = serde_json::json!(6);
    let windowed = regatta_torch::model_from_config(&json, "config.json").unwrap();
    assert_eq!(windowed.kv_layout().unwrap().sliding_window, Some(6));
    let rows: Vec<Prepared> = [14usize, 3, 25]
        .iter()
        .enumerate()
        .map(|(i, &n)| Prepared {
            prompt: (0..n as i64).map(|t| 5 + (t * 53 + i as i64 * 7) % 500).collect(),
            params: greedy(10),
            stream: RowStream::new(0, "w"),
        })
        .collect();
    let generator = Generator::new(
        windowed.as_ref(),
        &params,
        setup(1 << 20, 2, 5),
        128,
        Vec::new(),
        Device::Cpu,
    )
    .unwrap()
    .keep_logits();
    let (outputs, _) = run(&generator, &rows);
    let (unwindowed, _) = load(&fixture("mistral"));
    let mut differs_from_full_attention = false;
    for (row, out) in rows.iter().zip(&outputs) {
        let (tokens, steps) = full_window(windowed.as_ref(), &params, &row.prompt, 10);
        assert_eq!(out.tokens, tokens);
        for (step, expected) in steps.iter().enumerate() {
            assert!(max_diff(&out.logits[step], expected) < 1e-4);
        }
        let (_, plain) = full_window(unwindowed.as_ref(), &params, &row.prompt, 1);
        differs_from_full_attention |= max_diff(&out.logits[0], &plain[0]) > 1e-3;
    }
    assert!(
        differs_from_full_attention,
        "the window changed nothing: the test proves nothing"
    );
}

#[test]
fn rows_added_while_others_decode_join_the_running_batch_and_equal_a_one_shot_run() {
    tch::set_num_threads(1);
    let (model, params) = load(&fixture("llama"));
    let rows: Vec<Prepared> = (0..8)
        .map(|i| Prepared {
            prompt: (0..4 + i as i64 * 3)
                .map(|t| 3 + (t * 41 + i as i64 * 97) % 500)
                .collect(),
            params: greedy(10),
            stream: RowStream::new(0, &i.to_string()),
        })
        .collect();
    let generator = Generator::new(
        model.as_ref(),
        &params,
        setup(1 << 20, 8, 64),
        128,
        Vec::new(),
        Device::Cpu,
    )
    .unwrap()
    .stats_every(std::time::Duration::ZERO);
    let (expected, _) = run(&generator, &rows);

    // A first partition of four rows runs a few steps; a second partition's four rows
    // arrive while those still decode and run beside them.
    let mut session = generator.session().unwrap();
    let mut stats = Vec::new();
    let mut done = HashMap::new();
    let first: Vec<usize> = rows[..4].iter().map(|r| session.add(r.clone()).unwrap()).collect();
    for _ in 0..3 {
        done.extend(session.step(&|_| String::new(), &mut |s| stats.push(s)).unwrap());
    }
    assert!(done.is_empty(), "the first rows are still running");
    let second: Vec<usize> = rows[4..].iter().map(|r| session.add(r.clone()).unwrap()).collect();
    stats.clear();
    done.extend(session.step(&|_| String::new(), &mut |s| stats.push(s)).unwrap());
    assert_eq!(
        stats.last().unwrap().running,
        8,
        "both partitions' rows run in one batch: {stats:?}"
    );
    while !session.is_idle() {
        done.extend(session.step(&|_| String::new(), &mut |_| {}).unwrap());
    }
    for (i, seq) in first.iter().chain(&second).enumerate() {
        assert_eq!(done[seq].tokens, expected[i].tokens, "row {i}");
    }
    // A row needing more cache than the whole budget is refused, naming the budget.
    let small = Generator::new(
        model.as_ref(),
        &params,
        setup(20 * 4 * 256, 8, 64),
        128,
        Vec::new(),
        Device::Cpu,
    )
    .unwrap();
    let mut session = small.session().unwrap();
    let long = Prepared {
        prompt: vec![5; 90],
        params: greedy(20),
        stream: RowStream::new(0, "long"),
    };
    let reason = session.add(long).unwrap_err();
    assert!(
        matches!(reason, RowError::Refused(regatta_scorer::Error::CacheTooSmall { .. })),
        "{reason}"
    );
    assert!(reason.to_string().contains("raise the KV cache budget"), "{reason}");
}

#[test]
fn a_stop_string_split_across_tokens_ends_the_row_at_the_token_completing_it() {
    tch::set_num_threads(1);
    let (model, params) = load(&fixture("llama"));
    let generator = on_cpu(model.as_ref(), &params, setup(1 << 20, 4, 64));
    let row = |stop: Vec<String>| Prepared {
        prompt: vec![5, 17, 230, 41, 9],
        params: SamplingParams { stop, ..greedy(30) },
        stream: RowStream::new(0, "s"),
    };
    // Each token reads as "<id>": a stop string made of one token's end and the next one's
    // start is only ever seen across two tokens.
    let text = |ids: &[i64]| ids.iter().map(|t| format!("<{t}>")).collect::<String>();
    let (free, _) = generator.run_timed(&[row(Vec::new())], &text, &mut |_| {}).unwrap();
    let tokens = free[0].as_ref().unwrap().tokens.clone();
    assert_eq!(tokens.len(), 30);
    // The first place where "<a" + "><b" spans two tokens' text and did not occur before.
    let (at, stop) = (12..tokens.len())
        .map(|i| {
            let (a, b) = (tokens[i - 1].to_string(), tokens[i].to_string());
            (i, format!("{}><{}", &a[a.len() - 1..], &b[..1]))
        })
        .find(|(i, stop)| !text(&tokens[..*i]).contains(stop.as_str()))
        .expect("some adjacent pair is new");
    let (stopped, _) = generator
        .run_timed(&[row(vec![stop.clone()])], &text, &mut |_| {})
        .unwrap();
    let out = stopped[0].as_ref().unwrap();
    assert_eq!(out.finish, Finish::Stop, "{stop:?}");
    assert_eq!(out.tokens, tokens[..=at], "ended at the token that completed {stop:?}");
}

/// Rows of a chat-like shape: a common header (a system prompt) and a tail of their own,
/// greedy, with log-probabilities.
fn header_rows(rows: usize, header: usize) -> Vec<Prepared> {
    let header: Vec<i64> = (0..header as i64).map(|t| 3 + (t * 53) % 500).collect();
    (0..rows)
        .map(|i| Prepared {
            prompt: header
                .iter()
                .copied()
                .chain((0..3 + i as i64 % 4).map(|t| 7 + (t * 31 + i as i64 * 89) % 500))
                .collect(),
            params: SamplingParams {
                logprobs: true,
                ..greedy(8)
            },
            stream: RowStream::new(0, &i.to_string()),
        })
        .collect()
}

#[test]
fn rows_sharing_a_prefix_take_its_cached_blocks_and_generate_what_they_would_alone() {
    tch::set_num_threads(1);
    for name in ["llama", "qwen2"] {
        let (model, params) = load(&fixture(name));
        // Two rows at a time: later rows join after the header's blocks are registered.
        let rows = header_rows(6, 22);
        let with = |caching: bool| {
            let setup = GenerationSetup {
                prefix_caching: caching,
                ..setup(1 << 20, 2, 64)
            };
            on_cpu(model.as_ref(), &params, setup)
                .run_timed(&rows, &|_| String::new(), &mut |_| {})
                .unwrap()
        };
        let (cached, cached_timings) = with(true);
        let (plain, plain_timings) = with(false);
        assert_eq!(plain_timings.cached_tokens, 0);
        // The header is 22 tokens: 5 whole blocks of 4 are shared by every row after the
        // first two (and so prefilled only once per pair running together).
        assert!(cached_timings.cached_tokens >= 4 * 20, "{name}: {cached_timings:?}");
        assert_eq!(
            cached_timings.prefill_tokens + cached_timings.cached_tokens,
            plain_timings.prefill_tokens,
            "{name}: every prompt token is either prefilled or found cached"
        );
        for (i, (a, b)) in cached.iter().zip(&plain).enumerate() {
            let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
            assert_same_row(&format!("{name} row {i}"), a, b, 1e-4);
        }
    }
}

#[test]
fn greedy_tokens_chosen_where_the_logits_are_equal_the_host_choice() {
    tch::set_num_threads(1);
    let (model, params) = load(&fixture("mistral"));
    let rows = header_rows(5, 9);
    let run_with = |keep: bool| {
        let generator = on_cpu(model.as_ref(), &params, setup(1 << 20, 3, 64));
        let generator = if keep { generator.keep_logits() } else { generator };
        run(&generator, &rows).0
    };
    // Kept logits make every choice on the host (`choose`); without, greedy rows are
    // chosen by the tensor's argmax and log-sum-exp.
    let host = run_with(true);
    let device = run_with(false);
    for (i, (h, d)) in host.iter().zip(&device).enumerate() {
        assert_same_row(&format!("row {i}"), h, d, 1e-9);
        assert_eq!(h.logprobs.len(), h.tokens.len());
        assert!(d.logits.is_empty());
    }
}

#[test]
fn fixed_shape_decode_steps_equal_transformers_generate_and_the_eager_steps() {
    tch::set_num_threads(1);
    for name in FIXTURES {
        let (model, params) = load(&fixture(name));
        let expected: HashMap<String, Tensor> = Tensor::read_safetensors(fixture(name).join("generate.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
        let rows: Vec<Prepared> = (0..4)
            .map(|i| Prepared {
                prompt: ids(&expected[&format!("prompt.{i}")]),
                params: SamplingParams {
                    logprobs: true,
                    ..greedy(16)
                },
                stream: RowStream::new(0, &i.to_string()),
            })
            .collect();
        // Three sequences at a time: decode steps of 3, 2 and 1 rows run padded to 4, 2 and
        // 1 rows, their keys to a power of two (what a CUDA graph replays).
        let make = || Generator::new(model.as_ref(), &params, setup(1 << 20, 3, 8), 128, vec![2], Device::Cpu).unwrap();
        let run_timed = |generator: &Generator| {
            let (outputs, timings) = generator.run_timed(&rows, &|_| String::new(), &mut |_| {}).unwrap();
            (outputs.into_iter().map(Result::unwrap).collect::<Vec<_>>(), timings)
        };
        let (fixed, timings) = run_timed(&make().fixed_shape_decode());
        assert!(timings.graph_steps > 0, "{name}: no step ran in a fixed shape");
        assert_eq!(timings.graphs_captured, 0, "{name}: no graph is captured on the CPU");
        assert_eq!(timings.graphs_off, None);
        let (eager, eager_timings) = run_timed(&make());
        assert_eq!(eager_timings.graph_steps, 0, "{name}: graphs are for CUDA only");
        for (i, (f, e)) in fixed.iter().zip(&eager).enumerate() {
            assert_eq!(
                f.tokens,
                ids(&expected[&format!("tokens.{i}")]),
                "{name} prompt {i}: tokens"
            );
            assert_same_row(&format!("{name} prompt {i}"), f, e, 1e-5);
            assert_eq!(f.logprobs.len(), f.tokens.len());
        }
    }
}

#[test]
fn sampled_rows_and_kept_logits_decode_in_fixed_shapes_as_they_do_eagerly() {
    tch::set_num_threads(1);
    let (model, params) = load(&fixture("qwen2"));
    let sampled = sampled(12);
    // Sampling rows and greedy rows in the same decode steps, five at a time (padded to 8).
    let rows: Vec<Prepared> = (0..5)
        .map(|i| Prepared {
            prompt: vec![3 + i, 50, 60 + i],
            params: if i % 2 == 0 {
                sampled.clone()
            } else {
                SamplingParams {
                    logprobs: true,
                    ..greedy(12)
                }
            },
            stream: RowStream::new(42, &format!("row-{i}")),
        })
        .collect();
    let make = || {
        Generator::new(
            model.as_ref(),
            &params,
            setup(1 << 20, 5, 64),
            128,
            Vec::new(),
            Device::Cpu,
        )
        .unwrap()
    };
    let runs = |keep: bool| {
        let fixed = if keep { make().keep_logits() } else { make() }.fixed_shape_decode();
        let eager = if keep { make().keep_logits() } else { make() };
        let (fixed_out, timings) = fixed.run_timed(&rows, &|_| String::new(), &mut |_| {}).unwrap();
        assert!(
            timings.graph_steps >= 11,
            "{} decode steps in fixed shapes",
            timings.graph_steps
        );
        (
            fixed_out.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
            run(&eager, &rows).0,
        )
    };
    for keep in [false, true] {
        let (fixed, eager) = runs(keep);
        for (i, (f, e)) in fixed.iter().zip(&eager).enumerate() {
            assert_same_row(&format!("row {i} (logits kept: {keep})"), f, e, 1e-5);
            assert_eq!(f.logprobs.len(), 12);
            assert_eq!(f.logits.len(), if keep { 12 } else { 0 });
            for (a, b) in f.logits.iter().zip(&e.logits) {
                let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                assert!(diff < 1e-4, "row {i}: logits differ by {diff}");
            }
        }
    }
}
