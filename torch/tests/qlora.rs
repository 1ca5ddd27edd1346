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
