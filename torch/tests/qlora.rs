#![allow(clippy::unwrap_used)]
//! QLoRA's 4-bit quantization against bitsandbytes (0.50, its CPU backend) on fixtures it
//! made from the Llama fixture's projection weights and two random tensors
//! (scripts/make-qlora-fixtures.py): NF4 and FP4, blocksize 64, with and without double
//! quantization.

use std::collections::HashMap;

use regatta_torch::tch::{Kind, Tensor};
use regatta_trainer::quant::{dequantize_4bit, double_quantize_around, dynamic_map, quantize_4bit, Absmax, Quant4Type};

fn fixture() -> HashMap<String, Tensor> {
    let path = format!("{}/tests/fixtures/qlora/bnb.safetensors", env!("CARGO_MANIFEST_DIR"));
    Tensor::read_safetensors(path).unwrap().into_iter().collect()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    let t = t.to_kind(Kind::Float).contiguous().view([-1]);
    let mut out = vec![0f32; t.numel()];
    t.copy_data(&mut out, t.numel());
    out
}

fn bytes(t: &Tensor) -> Vec<u8> {
    let t = t.contiguous().view([-1]);
    assert_eq!(t.kind(), Kind::Uint8);
    let mut out = vec![0u8; t.numel()];
    t.copy_data(&mut out, t.numel());
    out
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn nf4_and_fp4_codes_and_absmax_equal_bitsandbytes_bit_for_bit() {
    let fixture = fixture();
    assert_eq!(
        bits(&f32s(&fixture["dynamic_map"])),
        bits(&dynamic_map()),
        "the dynamic 8-bit map is bitsandbytes' own"
    );
    let names: Vec<String> = fixture
        .keys()
        .filter_map(|k| k.strip_suffix(".input").map(str::to_string))
        .collect();
    assert_eq!(names.len(), 9, "{names:?}");
    for name in &names {
        let input = f32s(&fixture[&format!("{name}.input")]);
        for kind in [Quant4Type::Nf4, Quant4Type::Fp4] {
            for double in [false, true] {
                let key = format!("{name}.{}.{}", kind.name(), if double { "double" } else { "plain" });
                let q = quantize_4bit(&input, 64, kind, double).unwrap();
                assert!(
                    q.packed == bytes(&fixture[&format!("{key}.packed")]),
                    "{key}: packed codes differ"
                );
                let expected_absmax = &fixture[&format!("{key}.absmax")];
                match &q.absmax {
                    Absmax::Plain(values) => {
                        assert!(bits(values) == bits(&f32s(expected_absmax)), "{key}: absmax differs")
                    }
                    Absmax::Double { codes, absmax, offset } => {
                        let bnb_offset = f32s(&fixture[&format!("{key}.offset")])[0];
                        // bitsandbytes' offset is torch's mean, rounded in torch's summation
                        // order; this one is the correctly rounded mean: at most an ulp apart.
                        let ulps = (offset.to_bits() as i64 - bnb_offset.to_bits() as i64).abs();
                        assert!(ulps <= 1, "{key}: offset {offset} vs {bnb_offset}");
                        assert!(codes == &bytes(expected_absmax), "{key}: absmax codes differ");
                        let nested = f32s(&fixture[&format!("{key}.nested_absmax")]);
                        for (a, b) in absmax.iter().zip(&nested) {
                            assert!((a - b).abs() <= 1e-6 * b.abs(), "{key}: nested absmax {a} vs {b}");
                        }
                        // Around bitsandbytes' own offset, every bit is its.
                        let Absmax::Plain(plain) = quantize_4bit(&input, 64, kind, false).unwrap().absmax else {
                            unreachable!()
                        };
                        match double_quantize_around(&plain, bnb_offset) {
                            Absmax::Double { codes, absmax, .. } => {
                                assert!(codes == bytes(expected_absmax), "{key}: absmax codes differ");
                                assert!(bits(&absmax) == bits(&nested), "{key}: nested absmax differs");
                            }
                            Absmax::Plain(_) => unreachable!(),
                        }
                    }
                }
                // Dequantized values equal bitsandbytes' dequantize_4bit (bit for bit where
                // the offset is, within an ulp of the absmax where it is not).
                let back = dequantize_4bit(&q);
                let want = f32s(&fixture[&format!("{key}.dequantized")]);
                assert_eq!(back.len(), want.len(), "{key}");
                for (i, (a, b)) in back.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                        "{key} element {i}: {a} vs {b}"
                    );
                }
                if !double {
                    // Equal as numbers (bitsandbytes' CPU kernel makes FP4's code 8 -0 in a
                    // partial last block and +0 elsewhere; both are zero).
                    assert!(back == want, "{key}: dequantized values differ");
                }
            }
        }
    }
}

#[test]
fn a_held_4bit_weight_dequantizes_on_libtorch_as_bitsandbytes_does() {
    use regatta_torch::QuantWeight;
    let fixture = fixture();
    for name in ["model.layers.0.mlp.down_proj.weight", "random.odd", "random.many"] {
        let input = &fixture[&format!("{name}.input")];
        for kind in [Quant4Type::Nf4, Quant4Type::Fp4] {
            for double in [false, true] {
                let key = format!("{name}.{}.{}", kind.name(), if double { "double" } else { "plain" });
                let held = QuantWeight::new(input, kind, 64, double, regatta_torch::tch::Device::Cpu).unwrap();
                let back = held.dequantize(Kind::Float);
                assert_eq!(back.size(), input.size(), "{key}");
                let rust = dequantize_4bit(&quantize_4bit(&f32s(input), 64, kind, double).unwrap());
                assert!(
                    bits(&f32s(&back)) == bits(&rust),
                    "{key}: libtorch and the pure dequantization differ"
                );
                if !double {
                    let want = f32s(&fixture[&format!("{key}.dequantized")]);
                    assert!(f32s(&back) == want, "{key}: bitsandbytes' dequantization differs");
                }
                // In bf16: the f32 values rounded once.
                let bf16 = held.dequantize(Kind::BFloat16);
                assert!(bf16.equal(&back.to_kind(Kind::BFloat16)), "{key}: bf16");
            }
        }
    }
    // Bytes held: half a byte a weight plus the absmax (4 bytes a block, or a byte a block
    // and 4 a nested block and the offset).
    let input = &fixture["random.many.input"];
    let plain = QuantWeight::new(input, Quant4Type::Nf4, 64, false, regatta_torch::tch::Device::Cpu).unwrap();
    let double = QuantWeight::new(input, Quant4Type::Nf4, 64, true, regatta_torch::tch::Device::Cpu).unwrap();
    assert_eq!(plain.bytes(), 300 * 64 / 2 + 300 * 4);
    assert_eq!(double.bytes(), 300 * 64 / 2 + 300 + 2 * 4 + 4);
}

#[test]
fn a_quantized_base_counts_as_parameters_and_flops_as_the_float_one_does() {
    use regatta_trainer::BaseQuantization;
    use regatta_trainer::LoraConfig;
    let dir = format!("{}/tests/fixtures/llama", env!("CARGO_MANIFEST_DIR"));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let hf = runtime.block_on(regatta_torch::HfModel::open(&dir)).unwrap();
    let model_with = |quantization| {
        let mut model = hf.model().unwrap();
        model
            .set_lora(&LoraConfig {
                rank: 4,
                base_quantization: quantization,
                ..LoraConfig::default()
            })
            .unwrap();
        model
    };
    let (float, nf4) = (model_with(BaseQuantization::None), model_with(BaseQuantization::Nf4));
    // The engine holds no projection weight; the model lists them to load.
    let engine_held = |m: &dyn regatta_torch::Model| m.blocks().into_iter().flatten().count();
    assert_eq!(engine_held(float.as_ref()) - engine_held(nf4.as_ref()), 2 * 7);
    assert_eq!(nf4.quantized_specs().len(), 2 * 7);
    assert!(nf4
        .quantized_specs()
        .iter()
        .all(|s| s.frozen && s.name.ends_with("proj.weight")));
    assert_eq!(
        regatta_torch::parameter_count(nf4.as_ref()),
        regatta_torch::parameter_count(float.as_ref())
    );
    assert_eq!(nf4.flops_per_token(16), float.flops_per_token(16));
    assert!(float.quantized_specs().is_empty());
}

fn qlora_fixture(name: &str) -> String {
    format!("{}/tests/fixtures/qlora/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// transformers' save_pretrained of the Llama fixture loaded with
/// BitsAndBytesConfig(load_in_4bit, nf4, double quantization) (make-qlora-fixtures.py).
fn open_bnb_llama() -> (tokio::runtime::Runtime, regatta_torch::HfModel) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let hf = runtime
        .block_on(regatta_torch::HfModel::open(&qlora_fixture("bnb-llama")))
        .unwrap();
    (runtime, hf)
}

#[test]
fn a_folder_bitsandbytes_quantized_reads_as_the_float_model_its_dequantization_gives() {
    let (runtime, hf) = open_bnb_llama();
    let model = hf.model().unwrap();
    hf.check(model.as_ref()).unwrap();
    let want: HashMap<String, Tensor> = Tensor::read_safetensors(qlora_fixture("llama-nf4-dequantized.safetensors"))
        .unwrap()
        .into_iter()
        .collect();
    let specs: Vec<_> = model
        .blocks()
        .into_iter()
        .flatten()
        .filter(|s| s.tied_to.is_none())
        .collect();
    assert_eq!(specs.len(), want.len());
    let mut quantized = 0;
    for spec in &specs {
        let read = runtime.block_on(hf.read(spec)).unwrap();
        let expected = &want[&spec.name];
        assert_eq!(read.size(), expected.size(), "{}", spec.name);
        assert!(
            bits(&f32s(&read)) == bits(&f32s(expected)),
            "{}: differs from bitsandbytes' dequantization",
            spec.name
        );
        quantized += usize::from(spec.name.ends_with("proj.weight"));
    }
    assert_eq!(
        quantized,
        2 * 7,
        "every projection of both layers was 4-bit in the folder"
    );
}

#[test]
fn quantized_folders_regatta_cannot_read_are_refused_by_name() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let source = qlora_fixture("bnb-llama");
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(format!("{source}/config.json")).unwrap()).unwrap();
    for (key, value, expected) in [
        ("load_in_8bit", serde_json::json!(true), "load_in_8bit (LLM.int8)"),
        ("quant_method", serde_json::json!("gptq"), "quant_method = \"gptq\""),
    ] {
        let dir = std::env::temp_dir().join(format!("regatta-bnb-{key}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(format!("{source}/model.safetensors"), dir.join("model.safetensors")).unwrap();
        let mut changed = config.clone();
        changed["quantization_config"][key] = value;
        std::fs::write(dir.join("config.json"), serde_json::to_vec(&changed).unwrap()).unwrap();
        let error = match runtime.block_on(regatta_torch::HfModel::open(dir.to_str().unwrap())) {
            Ok(_) => panic!("{key}: a folder Regatta cannot read was opened"),
            Err(e) => e.to_string(),
        };
        assert!(
            error.contains(expected) && error.contains("config.json"),
            "{key}: {error}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// How many quantized weights a run with `lora` takes from `hf` as the folder stores them.
fn taken_as_stored(
    runtime: &tokio::runtime::Runtime,
    hf: &regatta_torch::HfModel,
    lora: &regatta_trainer::LoraConfig,
) -> usize {
    let mut model = hf.model().unwrap();
    model.set_lora(lora).unwrap();
    runtime
        .block_on(regatta_torch::take_stored_quantized(
            model.as_mut(),
            Some(hf),
            regatta_torch::tch::Device::Cpu,
        ))
        .unwrap();
    model
        .quantized_specs()
        .iter()
        .filter(|s| model.holds_quantized(&s.name))
        .count()
}

#[test]
fn a_qlora_run_takes_a_4bit_folders_codes_as_stored_when_its_settings_match() {
    use regatta_trainer::BaseQuantization;
    use regatta_trainer::LoraConfig;
    let (runtime, hf) = open_bnb_llama();
    for (double, taken) in [(true, 14), (false, 0)] {
        let lora = LoraConfig {
            rank: 4,
            base_quantization: BaseQuantization::Nf4,
            double_quant: double,
            ..LoraConfig::default()
        };
        let held = taken_as_stored(&runtime, &hf, &lora);
        // The folder is NF4 with double quantization: a run asking for that takes all 14
        // projections as stored; one without double quantization quantizes them itself.
        assert_eq!(held, taken, "double_quant = {double}");
    }
}

/// Scores and greedy continuations of a few texts by the Llama fixture folder at `base`
/// with the fixture PEFT adapter on it, the base held as `asked`.
fn adapter_scores(
    runtime: &tokio::runtime::Runtime,
    base: &str,
    asked: regatta_scorer::AdapterBase,
    double_quant: bool,
) -> (Vec<(f64, String)>, u64, u64) {
    use regatta_torch::Scorer;
    use regatta_torch::TextTokenizer;
    use regatta_torch::{hold_base, Adapter};
    let fixtures = format!("{}/tests/fixtures", env!("CARGO_MANIFEST_DIR"));
    let hf = runtime.block_on(regatta_torch::HfModel::open(base)).unwrap();
    let mut adapter = runtime
        .block_on(Adapter::open(&format!("{fixtures}/llama-lora")))
        .unwrap();
    hold_base(&mut adapter.config, asked, double_quant, hf.stored_quantization());
    let tokenizer = runtime
        .block_on(TextTokenizer::load(&format!("{fixtures}/llama/tokenizer.json")))
        .unwrap();
    let scorer = runtime
        .block_on(Scorer::from_folder(
            &hf,
            Some(&adapter),
            0,
            tokenizer,
            (regatta_torch::tch::Device::Cpu, Kind::Float),
            None,
        ))
        .unwrap();
    let rows: Vec<(Vec<i64>, bool)> = [
        "the quick brown fox jumps over the lazy dog",
        "a b c d e f g h",
        "hello hello",
    ]
    .iter()
    .map(|text| scorer.tokenize(text).unwrap())
    .collect();
    let scored = scorer
        .score(&rows, 6)
        .unwrap()
        .into_iter()
        .map(|s| (s.log_likelihood, s.generated))
        .collect();
    (scored, scorer.parameters(), scorer.quantized_bytes())
}

#[test]
fn an_adapter_scores_and_generates_on_a_4bit_base_as_on_bitsandbytes_dequantized_float_base() {
    use regatta_scorer::AdapterBase;
    regatta_torch::tch::set_num_threads(1);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let fixtures = format!("{}/tests/fixtures", env!("CARGO_MANIFEST_DIR"));
    // The reference: the adapter on the float model bitsandbytes' NF4 round trip (double
    // quantization, blocks of 64) gives.
    let dequantized = std::env::temp_dir().join(format!("regatta-qlora-score-{}", std::process::id()));
    std::fs::create_dir_all(&dequantized).unwrap();
    std::fs::copy(format!("{fixtures}/llama/config.json"), dequantized.join("config.json")).unwrap();
    std::fs::copy(
        qlora_fixture("llama-nf4-dequantized.safetensors"),
        dequantized.join("model.safetensors"),
    )
    .unwrap();
    let (want, params, none) = adapter_scores(&runtime, dequantized.to_str().unwrap(), AdapterBase::None, false);
    let float_base = format!("{fixtures}/llama");
    let close = |got: &[(f64, String)], what: &str| {
        for ((a, text_a), (b, text_b)) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-4, "{what}: log-likelihood {a} vs {b}");
            assert_eq!(text_a, text_b, "{what}: greedy continuation");
        }
    };
    // Quantized by Regatta at load from the float folder.
    let (ours, ours_params, held) = adapter_scores(&runtime, &float_base, AdapterBase::Nf4, true);
    close(&ours, "nf4 from the float folder");
    assert_eq!(
        ours_params, params,
        "a 4-bit base counts its parameters as the float one"
    );
    // Every projection of both layers in 4 bits: half a byte per weight, one absmax code
    // per block of 64, a nested f32 absmax per 256 blocks and the offset.
    let shapes: [u64; 7] = [64 * 64, 32 * 64, 32 * 64, 64 * 64, 160 * 64, 160 * 64, 64 * 160];
    let four_bit: u64 = 2 * shapes
        .iter()
        .map(|n| n / 2 + n / 64 + (n / 64).div_ceil(256) * 4 + 4)
        .sum::<u64>();
    assert_eq!((none, held), (0, four_bit), "bytes held quantized");
    // A folder bitsandbytes stored in 4 bits: `auto` keeps its codes (and the same answers).
    let (stored, _, stored_held) = adapter_scores(&runtime, &qlora_fixture("bnb-llama"), AdapterBase::Auto, false);
    close(&stored, "auto on the bitsandbytes folder");
    assert_eq!(stored_held, four_bit, "auto holds the bitsandbytes folder in 4 bits");
    // The rounding matters: on the float base the adapter scores otherwise, so the
    // equalities above mean the base really was held in 4 bits.
    let (float, _, float_held) = adapter_scores(&runtime, &float_base, AdapterBase::Auto, false);
    assert_eq!(
        float_held, 0,
        "auto on a float folder with a PEFT adapter holds it in float"
    );
    let moved = float
        .iter()
        .zip(&want)
        .map(|(a, b)| (a.0 - b.0).abs())
        .fold(0.0, f64::max);
    assert!(moved > 1e-3, "the float base scores as the 4-bit one ({moved})");
    let _ = std::fs::remove_dir_all(&dequantized);
}

#[test]
fn int8_codes_row_scales_and_dequantized_weights_equal_bitsandbytes_bit_for_bit() {
    use regatta_torch::QuantWeight;
    use regatta_trainer::quant::{dequantize_int8_rows, quantize_int8_rows};
    let fixture: HashMap<String, Tensor> = Tensor::read_safetensors(qlora_fixture("bnb-int8.safetensors"))
        .unwrap()
        .into_iter()
        .collect();
    let codes_of = |t: &Tensor| {
        let t = t.contiguous().view([-1]);
        assert_eq!(t.kind(), Kind::Int8);
        let mut out = vec![0i8; t.numel()];
        t.copy_data(&mut out, t.numel());
        out
    };
    let mut subjects: Vec<&str> = fixture.keys().filter_map(|k| k.strip_suffix(".input")).collect();
    subjects.sort();
    assert_eq!(subjects.len(), 8, "{subjects:?}");
    for name in subjects {
        let input = &fixture[&format!("{name}.input")];
        let cols = input.size()[1] as usize;
        // As int8_vectorwise_quant computes it on f32 weights, and on the weight rounded to
        // f16 first (what Int8Params, transformers' load_in_8bit, stores).
        for (key, values) in [("int8", f32s(input)), ("int8_f16", f32s(&input.to_kind(Kind::Half)))] {
            let what = format!("{name} {key}");
            let q = quantize_int8_rows(&values, cols).unwrap();
            assert!(
                q.codes == codes_of(&fixture[&format!("{name}.{key}.codes")]),
                "{what}: codes differ from bitsandbytes'"
            );
            assert_eq!(
                bits(&q.scales),
                bits(&f32s(&fixture[&format!("{name}.{key}.scales")])),
                "{what}: row scales"
            );
            let want = bits(&f32s(&fixture[&format!("{name}.{key}.dequantized")]));
            assert!(bits(&dequantize_int8_rows(&q)) == want, "{what}: dequantized");
        }
        // The held weight (f16 first, as Int8Params) dequantizes on libtorch to the same bits.
        let held = QuantWeight::new_int8(input, regatta_torch::tch::Device::Cpu).unwrap();
        let want = bits(&f32s(&fixture[&format!("{name}.int8_f16.dequantized")]));
        assert!(
            bits(&f32s(&held.dequantize(Kind::Float))) == want,
            "{name}: held int8 dequantized"
        );
        assert_eq!(
            held.bytes() as i64,
            input.numel() as i64 + input.size()[0] * 4,
            "{name}: bytes"
        );
    }
    // The all-zero row: absmax 0, codes 0, back to zeros.
    let zero = &fixture["random.zero_row.int8.codes"].get(5);
    assert_eq!(codes_of(zero), vec![0i8; 64]);
    assert!(QuantWeight::new_int8(
        &Tensor::zeros([4], (Kind::Float, regatta_torch::tch::Device::Cpu)),
        regatta_torch::tch::Device::Cpu
    )
    .unwrap_err()
    .to_string()
    .contains("2-D"));
}

/// Logits of the width-64 Llama fixture (every projection a multiple of bitsandbytes' CPU
/// block) with its base held as `lora` says, on `tokens`; the adapters are zero (B = 0),
/// so the logits are the base's.
fn base_logits(lora: &regatta_trainer::LoraConfig, tokens: &Tensor) -> (Tensor, u64) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let device = regatta_torch::tch::Device::Cpu;
    let hf = runtime
        .block_on(regatta_torch::HfModel::open(&qlora_fixture("llama64")))
        .unwrap();
    let mut model = hf.model().unwrap();
    model.set_lora(lora).unwrap();
    runtime
        .block_on(regatta_torch::load_quantized(model.as_mut(), &hf, device))
        .unwrap();
    let mut stored = HashMap::new();
    for spec in model.blocks().into_iter().flatten().filter(|s| s.tied_to.is_none()) {
        let tensor = if regatta_trainer::is_adapter(&spec.name) {
            Tensor::zeros(spec.shape.as_slice(), (Kind::Float, device))
        } else {
            runtime.block_on(hf.read(&spec)).unwrap()
        };
        stored.insert(spec.name.clone(), tensor);
    }
    let params = regatta_torch::arrange(model.as_ref(), &stored).unwrap();
    let logits = regatta_torch::tch::no_grad(|| regatta_torch::logits(model.as_ref(), &params, tokens));
    (logits, model.quantized_bytes())
}

#[test]
fn logits_of_a_quantized_base_equal_transformers_loading_it_with_bitsandbytes() {
    use regatta_trainer::BaseQuantization;
    regatta_torch::tch::set_num_threads(1);
    let fixture: HashMap<String, Tensor> = Tensor::read_safetensors(qlora_fixture("llama64-logits.safetensors"))
        .unwrap()
        .into_iter()
        .collect();
    let tokens = &fixture["tokens"];
    let float = &fixture["float.logits"];
    // Two layers of width 64, 4 heads of 16, 2 KV heads, MLP 128.
    let shapes: [u64; 7] = [64 * 64, 32 * 64, 32 * 64, 64 * 64, 128 * 64, 128 * 64, 64 * 128];
    let rows: [u64; 7] = [64, 32, 32, 64, 128, 128, 64];
    let four = |double: bool| {
        2 * shapes
            .iter()
            .map(|n| {
                n / 2
                    + if double {
                        n / 64 + (n / 64).div_ceil(256) * 4 + 4
                    } else {
                        n / 64 * 4
                    }
            })
            .sum::<u64>()
    };
    let int8 = 2 * shapes.iter().zip(rows).map(|(n, r)| n + r * 4).sum::<u64>();
    // transformers with BitsAndBytesConfig(load_in_4bit, compute dtype f32) for the 4-bit
    // types; for int8 the float model on LLM.int8's dequantized weights (transformers'
    // own 8-bit forward quantizes the activations too, which a QLoRA base does not).
    for (key, kind, double, bytes) in [
        ("nf4_double", BaseQuantization::Nf4, true, four(true)),
        ("nf4", BaseQuantization::Nf4, false, four(false)),
        ("fp4", BaseQuantization::Fp4, false, four(false)),
        ("int8_dequantized", BaseQuantization::Int8, false, int8),
    ] {
        let lora = regatta_trainer::LoraConfig {
            rank: 4,
            base_quantization: kind,
            double_quant: double,
            ..regatta_trainer::LoraConfig::default()
        };
        let (got, held) = base_logits(&lora, tokens);
        let want = &fixture[&format!("{key}.logits")];
        let diff = (&got - want).abs().max().double_value(&[]);
        assert!(diff < 1e-4, "{key}: logits differ from the reference by {diff}");
        // Quantization moved them: equality above is not the float model's.
        let moved = (want - float).abs().max().double_value(&[]);
        assert!(moved > 1e-2, "{key}: the reference is the float model ({moved})");
        assert_eq!(held, bytes, "{key}: bytes held quantized");
    }
    let (plain, held) = base_logits(&regatta_trainer::LoraConfig::default(), tokens);
    let diff = (&plain - float).abs().max().double_value(&[]);
    assert!(
        diff < 1e-4 && held == 0,
        "the float base: {diff}, {held} bytes quantized"
    );
}

#[test]
fn an_8bit_folder_reads_as_llm_int8_dequantizes_it_and_an_int8_run_takes_its_codes() {
    use regatta_trainer::BaseQuantization;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // transformers' save_pretrained of the Llama fixture loaded with load_in_8bit.
    let source = qlora_fixture("bnb-llama-int8");
    let hf = runtime.block_on(regatta_torch::HfModel::open(&source)).unwrap();
    assert_eq!(hf.stored_quantization(), Some((BaseQuantization::Int8, 0, false)));
    let model = hf.model().unwrap();
    hf.check(model.as_ref()).unwrap();
    let want: HashMap<String, Tensor> = Tensor::read_safetensors(qlora_fixture("llama-int8-dequantized.safetensors"))
        .unwrap()
        .into_iter()
        .collect();
    let mut quantized = 0;
    for spec in model.blocks().into_iter().flatten().filter(|s| s.tied_to.is_none()) {
        let read = runtime.block_on(hf.read(&spec)).unwrap();
        assert!(
            bits(&f32s(&read)) == bits(&f32s(&want[&spec.name])),
            "{}: differs from bitsandbytes' int8 dequantization",
            spec.name
        );
        quantized += usize::from(spec.name.ends_with("proj.weight"));
    }
    assert_eq!(quantized, 2 * 7);
    // An int8 run takes the codes as stored; a 4-bit one quantizes the float weights itself.
    for (kind, taken) in [(BaseQuantization::Int8, 14), (BaseQuantization::Nf4, 0)] {
        let lora = regatta_trainer::LoraConfig {
            rank: 4,
            base_quantization: kind,
            ..regatta_trainer::LoraConfig::default()
        };
        assert_eq!(taken_as_stored(&runtime, &hf, &lora), taken, "{kind:?}");
    }
    // A weight_format other than row-major, and row scales of the wrong length, are refused
    // naming the weight.
    let tensors: Vec<(String, Tensor)> = Tensor::read_safetensors(format!("{source}/model.safetensors")).unwrap();
    let module = "model.layers.1.mlp.up_proj";
    for (what, change, expected) in [
        ("format", format!("{module}.weight_format"), "weight_format"),
        ("scales", format!("{module}.SCB"), "row scales"),
    ] {
        let dir = std::env::temp_dir().join(format!("regatta-bnb8-{what}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(format!("{source}/config.json"), dir.join("config.json")).unwrap();
        let edited: Vec<(String, Tensor)> = tensors
            .iter()
            .map(|(name, t)| {
                let t = if *name != change {
                    t.shallow_clone()
                } else if what == "format" {
                    Tensor::from_slice(&[1u8]).view([])
                } else {
                    t.narrow(0, 0, t.size()[0] - 1)
                };
                (name.clone(), t)
            })
            .collect();
        Tensor::write_safetensors(&edited, dir.join("model.safetensors")).unwrap();
        let error = match runtime.block_on(regatta_torch::HfModel::open(dir.to_str().unwrap())) {
            Ok(_) => panic!("{what}: a broken 8-bit folder was opened"),
            Err(e) => e.to_string(),
        };
        assert!(
            error.contains(&format!("{module}.weight")) && error.contains(expected),
            "{what}: {error}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_4bit_quant_state_beyond_what_bitsandbytes_writes_is_refused_naming_the_weight() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let source = qlora_fixture("bnb-llama");
    let state = "model.layers.0.mlp.down_proj.weight.quant_state.bitsandbytes__nf4";
    let tensors: Vec<(String, Tensor)> = Tensor::read_safetensors(format!("{source}/model.safetensors")).unwrap();
    let original: serde_json::Value = {
        let t = &tensors.iter().find(|(n, _)| n == state).unwrap().1;
        serde_json::from_slice(&bytes(t)).unwrap()
    };
    for (what, key, value, expected) in [
        // Finite as f64, infinite as the f32 it is held in.
        (
            "offset",
            "nested_offset",
            serde_json::json!(1e39),
            "nested_offset of 1e39",
        ),
        (
            "shape",
            "shape",
            serde_json::json!([64, 160.5]),
            "positive whole dimensions",
        ),
        ("dtype", "dtype", serde_json::json!("float64"), "dtype \"float64\""),
    ] {
        let mut changed = original.clone();
        changed[key] = value;
        let json = serde_json::to_vec(&changed).unwrap();
        let dir = std::env::temp_dir().join(format!("regatta-bnb-state-{what}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(format!("{source}/config.json"), dir.join("config.json")).unwrap();
        let edited: Vec<(String, Tensor)> = tensors
            .iter()
            .map(|(name, t)| {
                let t = if name == state {
                    Tensor::from_slice(&json)
                } else {
                    t.shallow_clone()
                };
                (name.clone(), t)
            })
            .collect();
        Tensor::write_safetensors(&edited, dir.join("model.safetensors")).unwrap();
        let error = match runtime.block_on(regatta_torch::HfModel::open(dir.to_str().unwrap())) {
            Ok(_) => panic!("{what}: a quant_state bitsandbytes never writes was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(
            error.contains("model.layers.0.mlp.down_proj.weight") && error.contains(expected),
            "{what}: {error}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
