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
    use regatta_torch::quant::QuantWeight;
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
    use regatta_trainer::lora::BaseQuantization;
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
        regatta_torch::model::parameter_count(nf4.as_ref()),
        regatta_torch::model::parameter_count(float.as_ref())
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

#[test]
fn a_qlora_run_takes_a_4bit_folders_codes_as_stored_when_its_settings_match() {
    use regatta_trainer::lora::BaseQuantization;
    use regatta_trainer::LoraConfig;
    let (runtime, hf) = open_bnb_llama();
    for (double, taken) in [(true, 14), (false, 0)] {
        let mut model = hf.model().unwrap();
        model
            .set_lora(&LoraConfig {
                rank: 4,
                base_quantization: BaseQuantization::Nf4,
                double_quant: double,
                ..LoraConfig::default()
            })
            .unwrap();
        runtime
            .block_on(regatta_torch::executor::take_stored_quantized(
                model.as_mut(),
                Some(&hf),
                regatta_torch::tch::Device::Cpu,
            ))
            .unwrap();
        let held = model
            .quantized_specs()
            .iter()
            .filter(|s| model.holds_quantized(&s.name))
            .count();
        // The folder is NF4 with double quantization: a run asking for that takes all 14
        // projections as stored; one without double quantization quantizes them itself.
        assert_eq!(held, taken, "double_quant = {double}");
    }
}
