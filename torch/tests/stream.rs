#![allow(clippy::unwrap_used)]
//! The streaming loader over real files: a folder of plain, zstd and gzip JSONL and a
//! Parquet file, read by loaders on 2 ranks, stopped mid-epoch, resumed from the merged
//! shard states on 3 ranks, then on 1 to the end of the epoch: every document is trained
//! on exactly once. Also: a resume on the same world size gives the rows an uninterrupted
//! run gives; weights set each source's share; bad rows are skipped and reported with
//! file and offset; a missing prefix is named.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use regatta_torch::stream::{plan, Loader, LoaderSpec, Row};
use regatta_torch::TextTokenizer;
use regatta_trainer::stream::{merge_states, rank_shards, DataPlan, LoaderState};
use regatta_trainer::TokenizerSettings;
use regatta_trainer::{DataConfig, SourceConfig};

const CONTEXT: usize = 24;

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("regatta-stream-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn tokenizer() -> Arc<TextTokenizer> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tokenizer.json");
    Arc::new(TextTokenizer::from_json(&std::fs::read(path).unwrap(), "data/tokenizer.json").unwrap())
}

fn settings() -> Arc<TokenizerSettings> {
    Arc::new(TokenizerSettings::from_json(&serde_json::json!({"eos_token": "</s>"})))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn text(n: usize) -> String {
    let words = [
        "sea", "ship", "wind", "harbour", "sail", "rope", "tide", "gull", "mast", "keel",
    ];
    let len = 3 + (n * 7919) % 40;
    (0..len)
        .map(|i| words[(n * 31 + i * 17) % words.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// Lines of `count` documents numbered from `first`, and each line's byte offset.
fn jsonl(first: usize, count: usize) -> (String, Vec<u64>) {
    let mut out = String::new();
    let mut offsets = Vec::new();
    for n in first..first + count {
        offsets.push(out.len() as u64);
        out.push_str(&format!(
            "{}\n",
            serde_json::json!({"id": n, "text": format!("doc {n}: {}", text(n))})
        ));
    }
    (out, offsets)
}

/// A source folder with every format; returns the key of every document.
fn write_corpus(dir: &Path) -> Vec<String> {
    let web = dir.join("web");
    std::fs::create_dir_all(web.join("more")).unwrap();
    let url = web.to_str().unwrap().to_string();
    let mut keys = Vec::new();
    let (plain, offsets) = jsonl(0, 400);
    std::fs::write(web.join("a.jsonl"), &plain).unwrap();
    keys.extend(offsets.iter().map(|o| format!("{url}/a.jsonl@{o}")));
    let (zst, offsets) = jsonl(400, 120);
    std::fs::write(web.join("b.jsonl.zst"), zstd::encode_all(zst.as_bytes(), 3).unwrap()).unwrap();
    keys.extend(offsets.iter().map(|o| format!("{url}/b.jsonl.zst@{o}")));
    let (gz, offsets) = jsonl(520, 80);
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(gz.as_bytes()).unwrap();
    std::fs::write(web.join("more/c.json.gz"), encoder.finish().unwrap()).unwrap();
    keys.extend(offsets.iter().map(|o| format!("{url}/more/c.json.gz@{o}")));
    let rows: Vec<(String, Option<String>)> = (600..660).map(|n| (n.to_string(), Some(text(n)))).collect();
    std::fs::write(
        web.join("d.parquet"),
        regatta_scorer::rows_to_parquet(&rows, 7).unwrap(),
    )
    .unwrap();
    keys.extend((0..60).map(|i| format!("{url}/d.parquet#{}@{}", i / 7, i % 7)));
    std::fs::write(web.join("README.md"), "not data").unwrap();
    keys
}

fn data(sources: Vec<(&Path, f64)>, shards: usize, epochs: Option<u32>) -> DataConfig {
    DataConfig {
        path: String::new(),
        sources: sources
            .into_iter()
            .map(|(p, weight)| SourceConfig {
                path: p.to_str().unwrap().to_string(),
                weight,
            })
            .collect(),
        shards,
        epochs,
        prefetch: 8,
        ..DataConfig::default()
    }
}

struct Ranks {
    loaders: Vec<Loader>,
}

impl Ranks {
    fn start(
        rt: &tokio::runtime::Runtime,
        plan: &Arc<DataPlan>,
        state: &LoaderState,
        world: usize,
        after: &[Option<usize>],
    ) -> Self {
        let loaders = (0..world)
            .map(|rank| {
                let spec = LoaderSpec {
                    plan: plan.clone(),
                    state: state.clone(),
                    shards: rank_shards(plan.shards, world, rank),
                    context: CONTEXT,
                    prefetch: 8,
                    after: after.get(rank).copied().flatten(),
                };
                Loader::start(spec, tokenizer(), settings(), rt.handle().clone()).unwrap()
            })
            .collect();
        Self { loaders }
    }

    /// One step: `per_rank` rows from every rank.
    fn step(&mut self, per_rank: usize) -> Vec<Row> {
        self.loaders
            .iter_mut()
            .flat_map(|l| l.take(per_rank).unwrap())
            .collect()
    }

    fn any_left(&mut self) -> bool {
        self.loaders.iter_mut().any(|l| l.has_more())
    }

    fn lasts(&self) -> Vec<Option<usize>> {
        self.loaders.iter().map(Loader::last_shard).collect()
    }

    fn state(&self, plan: &DataPlan) -> LoaderState {
        merge_states(
            plan.fingerprint,
            plan.shards,
            self.loaders.iter().map(Loader::states).collect(),
        )
        .unwrap()
    }
}

fn counts(rows: &[Row]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for key in rows.iter().flat_map(|r| r.keys.iter()) {
        *out.entry(key.clone()).or_insert(0) += 1;
    }
    out
}

#[test]
fn an_epoch_resumed_on_other_world_sizes_trains_on_every_document_exactly_once() {
    let dir = temp_dir("accounting");
    let expected = write_corpus(&dir);
    let rt = runtime();
    let plan = Arc::new(
        rt.block_on(plan(&data(vec![(&dir.join("web"), 1.0)], 6, Some(1)), 42))
            .unwrap(),
    );
    // A global batch of 6 rows: 3 per rank on 2 ranks, 2 on 3, 6 on 1.
    let mut rows = Vec::new();
    let mut ranks = Ranks::start(&rt, &plan, &plan.start(), 2, &[]);
    for _ in 0..9 {
        rows.extend(ranks.step(3));
    }
    let state = ranks.state(&plan);
    drop(ranks);
    let mut ranks = Ranks::start(&rt, &plan, &state, 3, &[]);
    for _ in 0..11 {
        rows.extend(ranks.step(2));
    }
    let state = ranks.state(&plan);
    drop(ranks);
    let mut ranks = Ranks::start(&rt, &plan, &state, 1, &[]);
    let mut steps = 20;
    while ranks.any_left() {
        rows.extend(ranks.step(6));
        steps += 1;
        assert!(steps < 10_000, "the epoch never ends");
    }
    let seen = counts(&rows);
    let repeated: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(repeated.is_empty(), "documents trained on twice: {repeated:?}");
    let mut want = expected.clone();
    want.sort();
    let got: Vec<String> = seen.keys().cloned().collect();
    let missing: Vec<_> = want.iter().filter(|k| !seen.contains_key(*k)).take(5).collect();
    assert!(missing.is_empty(), "documents never trained on: {missing:?}");
    assert_eq!(got, want);
    // Rows are real: the tokens learned add up to every document's (all but padding).
    let learned: usize = rows.iter().map(|r| r.targets.iter().filter(|t| **t >= 0).count()).sum();
    assert!(learned > 20_000, "{learned}");
    assert!(steps > 25, "{steps}");
}

#[test]
fn a_resume_on_the_same_world_size_gives_the_uninterrupted_rows() {
    let dir = temp_dir("same");
    write_corpus(&dir);
    let rt = runtime();
    // One epoch to its end: shards run out one by one and the rest go on. Three rows a
    // step over two shards a rank: the round-robin is mid-cycle at most stops.
    let plan = Arc::new(
        rt.block_on(plan(&data(vec![(&dir.join("web"), 1.0)], 4, Some(1)), 7))
            .unwrap(),
    );
    let mut whole = Ranks::start(&rt, &plan, &plan.start(), 2, &[]);
    let mut straight = Vec::new();
    while whole.any_left() {
        straight.extend(whole.step(3));
    }
    let steps = straight.len() / 6;
    let tokens = |rows: &[Row]| {
        rows.iter()
            .map(|r| (r.inputs.clone(), r.targets.clone()))
            .collect::<Vec<_>>()
    };
    for stop in [steps / 3, steps / 2 + 1, steps - 5, steps - 2] {
        let mut first = Ranks::start(&rt, &plan, &plan.start(), 2, &[]);
        let mut resumed: Vec<Row> = (0..stop).flat_map(|_| first.step(3)).collect();
        let (state, lasts) = (first.state(&plan), first.lasts());
        drop(first);
        let mut second = Ranks::start(&rt, &plan, &state, 2, &lasts);
        while second.any_left() {
            resumed.extend(second.step(3));
        }
        assert_eq!(
            tokens(&straight),
            tokens(&resumed),
            "stopped after step {stop} of {steps}"
        );
    }
}

#[test]
fn weights_set_each_sources_share_of_tokens_and_sources_repeat_without_epochs() {
    let dir = temp_dir("weights");
    for (name, first, count) in [("big", 0, 400), ("small", 5000, 40)] {
        std::fs::create_dir_all(dir.join(name)).unwrap();
        std::fs::write(dir.join(name).join("x.jsonl"), jsonl(first, count).0).unwrap();
    }
    let rt = runtime();
    let config = data(vec![(&dir.join("big"), 3.0), (&dir.join("small"), 1.0)], 2, None);
    let plan = Arc::new(rt.block_on(plan(&config, 3)).unwrap());
    let mut ranks = Ranks::start(&rt, &plan, &plan.start(), 1, &[]);
    let rows: Vec<Row> = (0..300).flat_map(|_| ranks.step(4)).collect();
    let seen = counts(&rows);
    let from = |source: &str| {
        seen.iter()
            .filter(|(k, _)| k.contains(source))
            .map(|(_, n)| n)
            .sum::<usize>()
    };
    let (big, small) = (from("/big/"), from("/small/"));
    let share = big as f64 / (big + small) as f64;
    assert!((share - 0.75).abs() < 0.05, "big {big} small {small}");
    // 1200 rows are several passes over the small source: endless sources wrap around.
    assert!(seen.iter().any(|(k, n)| k.contains("/small/") && *n > 1));
}

#[test]
fn bad_rows_and_broken_files_are_skipped_reported_and_the_rest_is_read() {
    let dir = temp_dir("bad");
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    let (good, offsets) = jsonl(0, 50);
    let mut lines: Vec<&str> = good.lines().collect();
    lines.insert(10, "{not json");
    lines.insert(20, r#"{"title": "no text field"}"#);
    let body = lines.join("\n") + "\n";
    let bad_at = body.find("{not json").unwrap();
    let missing_at = body.find("{\"title\"").unwrap();
    std::fs::write(src.join("a.jsonl"), &body).unwrap();
    // Several zstd blocks (128 KiB of text each), so the first ones decode whole.
    let compressed = zstd::encode_all(jsonl(100, 5000).0.as_bytes(), 3).unwrap();
    std::fs::write(src.join("b.jsonl.zst"), &compressed[..compressed.len() / 2]).unwrap();
    let rt = runtime();
    let plan = Arc::new(rt.block_on(plan(&data(vec![(&src, 1.0)], 1, Some(1)), 1)).unwrap());
    let mut ranks = Ranks::start(&rt, &plan, &plan.start(), 1, &[]);
    let mut rows = Vec::new();
    while ranks.any_left() {
        rows.extend(ranks.step(4));
    }
    let skipped: Vec<String> = ranks.loaders[0].take_skipped().into_iter().map(|s| s.what).collect();
    let url = src.to_str().unwrap();
    assert!(
        skipped
            .iter()
            .any(|s| s.starts_with(&format!("{url}/a.jsonl@{bad_at}: is not valid JSON"))),
        "{skipped:?}"
    );
    assert!(
        skipped
            .iter()
            .any(|s| s.starts_with(&format!("{url}/a.jsonl@{missing_at}:")) && s.contains("no `text`")),
        "{skipped:?}"
    );
    assert!(
        skipped
            .iter()
            .any(|s| s.contains("b.jsonl.zst@") && s.contains("unreadable")),
        "{skipped:?}"
    );
    let seen = counts(&rows);
    assert_eq!(seen.keys().filter(|k| k.contains("a.jsonl")).count(), offsets.len());
    // The readable start of the truncated file is trained on.
    assert!(
        seen.keys().filter(|k| k.contains("b.jsonl.zst")).count() > 10,
        "{seen:?}"
    );
    assert!(seen.values().all(|n| *n == 1));
}

#[test]
fn a_missing_prefix_or_a_changed_dataset_is_refused_by_name() {
    let dir = temp_dir("missing");
    let rt = runtime();
    let gone = dir.join("nothing-here");
    let err = rt
        .block_on(plan(&data(vec![(&gone, 1.0)], 1, None), 1))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(gone.to_str().unwrap()) && err.contains("nothing is listed"),
        "{err}"
    );
    std::fs::create_dir_all(dir.join("only-md")).unwrap();
    std::fs::write(dir.join("only-md/notes.md"), "x").unwrap();
    let err = rt
        .block_on(plan(&data(vec![(&dir.join("only-md"), 1.0)], 1, None), 1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("holds no .jsonl or .parquet file"), "{err}");
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("a.jsonl"), jsonl(0, 50).0).unwrap();
    let before = Arc::new(rt.block_on(plan(&data(vec![(&src, 1.0)], 1, None), 1)).unwrap());
    std::fs::write(src.join("a.jsonl"), jsonl(0, 51).0).unwrap();
    let after = Arc::new(rt.block_on(plan(&data(vec![(&src, 1.0)], 1, None), 1)).unwrap());
    let spec = LoaderSpec {
        plan: after,
        state: before.start(),
        shards: 0..1,
        context: CONTEXT,
        prefetch: 2,
        after: None,
    };
    let err = Loader::start(spec, tokenizer(), settings(), rt.handle().clone())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("the dataset's files changed"), "{err}");
}

#[test]
fn a_last_token_alone_makes_no_empty_row_and_its_document_is_still_counted() {
    let dir = temp_dir("tail");
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    // Byte tokens, context 4: "abcd" then "e" make a stream of 5 tokens, one full row
    // whose last target position holds the one-token document.
    std::fs::write(src.join("a.jsonl"), "{\"text\": \"abcd\"}\n{\"text\": \"e\"}\n").unwrap();
    let rt = runtime();
    let plan = Arc::new(rt.block_on(plan(&data(vec![(&src, 1.0)], 1, Some(1)), 1)).unwrap());
    let spec = LoaderSpec {
        plan: plan.clone(),
        state: plan.start(),
        shards: 0..1,
        context: 4,
        prefetch: 2,
        after: None,
    };
    let bytes = Arc::new(TextTokenizer::Bytes);
    let mut loader = Loader::start(spec, bytes, Arc::new(TokenizerSettings::default()), rt.handle().clone()).unwrap();
    let row = loader.take(1).unwrap().remove(0);
    assert_eq!(row.inputs, vec![97, 98, 99, 100]);
    assert_eq!(row.targets, vec![98, 99, 100, -100]);
    let url = src.to_str().unwrap();
    assert_eq!(row.keys, vec![format!("{url}/a.jsonl@0"), format!("{url}/a.jsonl@17")]);
    assert!(!loader.has_more(), "no row of padding alone follows");
}
