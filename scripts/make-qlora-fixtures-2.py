#!/usr/bin/env python3
"""More bitsandbytes fixtures made on the CPU (beside scripts/make-qlora-fixtures.py).

1. torch/tests/fixtures/qlora/bnb-int8.safetensors: bitsandbytes' LLM.int8 weight
   quantization (`int8_vectorwise_quant`, row-wise absmax, threshold 0) of the Llama
   fixture's layer-0 projection weights and of a random [300, 64] tensor with one all-zero
   row and a few zero entries ("random.zero_row"). For each subject NAME:
   `NAME.input` (f32), `NAME.int8.codes` (int8, CB), `NAME.int8.scales` (f32, SCB) and
   `NAME.int8.dequantized` (f32, `int8_vectorwise_dequant`). Also `NAME.int8_f16.*`, the
   same of the input cast to float16 first, which is what Linear8bitLt (transformers'
   load_in_8bit) stores.

2. torch/tests/fixtures/qlora/llama64/ (config.json, model.safetensors): a random
   LlamaForCausalLM (torch.manual_seed(11), init std 0.05) whose every linear input width
   is a multiple of 64, so bitsandbytes' CPU 4-bit kernels handle it; and
   torch/tests/fixtures/qlora/llama64-logits.safetensors: `tokens` (int64 [2, 12]) and the
   f32 logits [2, 12, 512] of that folder loaded by transformers unquantized
   (`float.logits`), in 4-bit (`nf4_double.logits`, `nf4.logits`, `fp4.logits`; compute
   dtype float32) and in 8-bit (`int8.logits`, LLM.int8 with llm_int8_threshold 6.0).
   The 4-bit forwards are bitsandbytes' f32 dequantize-then-linear path: on a CPU with
   AVX512-BF16, Linear4bit would otherwise repack the weights and run a bf16 kernel
   (machine-dependent, bf16-rounded); the script turns that off and prints how far it is.
   `int8_dequantized.logits`: the float model with each projection weight replaced by
   LLM.int8's round trip (f16 cast, `int8_vectorwise_quant`, `int8_vectorwise_dequant`),
   what a dequantize-then-linear int8 forward computes.

3. torch/tests/fixtures/qlora/llama-int8-dequantized.safetensors: the Llama fixture with
   every projection weight replaced by that same round trip.

4. torch/tests/fixtures/qlora/bnb-llama-int8/: the Llama fixture as transformers saves it
   loaded with BitsAndBytesConfig(load_in_8bit=True) (`W` int8, `W.SCB`, `W.weight_format`).

Run with a python holding torch, transformers (5.x) and bitsandbytes (0.50):
    python scripts/make-qlora-fixtures-2.py torch/tests/fixtures/llama torch/tests/fixtures/qlora
"""
import glob
import logging
import os
import sys

import bitsandbytes
import bitsandbytes.functional as F
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
model_dir, qlora_dir = sys.argv[1], sys.argv[2]
versions = {
    "bitsandbytes": bitsandbytes.__version__,
    "torch": torch.__version__,
    "transformers": transformers.__version__,
}

# ---------------------------------------------------------------- 1. LLM.int8 weights
weights = {}
for path in sorted(glob.glob(f"{model_dir}/*.safetensors")):
    if "model" in path.split("/")[-1]:
        weights.update(load_file(path))
subjects = {
    name: tensor.float()
    for name, tensor in sorted(weights.items())
    if name.startswith("model.layers.0.") and name.endswith("proj.weight")
}
generator = torch.Generator().manual_seed(7)
zero_row = torch.randn(300, 64, generator=generator) * 0.02
zero_row[5] = 0.0  # absmax 0: 127 / 0 = inf, 0 * inf = NaN, NaN -> int8 is 0 here
zero_row[0, 0] = zero_row[17, 63] = zero_row[299, 31] = 0.0
subjects["random.zero_row"] = zero_row

tensors = {}
for name, weight in subjects.items():
    tensors[f"{name}.input"] = weight.contiguous()
    for key, source in [("int8", weight), ("int8_f16", weight.half())]:
        codes, scales, outliers = F.int8_vectorwise_quant(source.clone())
        assert outliers is None and codes.dtype == torch.int8 and scales.dtype == torch.float32
        back = F.int8_vectorwise_dequant(codes, scales)
        assert back.dtype == torch.float32
        tensors[f"{name}.{key}.codes"] = codes.contiguous()
        tensors[f"{name}.{key}.scales"] = scales.contiguous()
        tensors[f"{name}.{key}.dequantized"] = back.contiguous()
        # The formula, checked: codes = round_half_even(x * fl(fl(1 / absmax) * 127)),
        # back = fl(fl(code * absmax) * f32(1 / 127)).
        absmax = source.abs().amax(dim=1).float()
        mine = torch.round(source.float() * (absmax.reciprocal() * 127.0).unsqueeze(1)).to(torch.int8)
        true_div = torch.round(source.float() * 127.0 / absmax.unsqueeze(1)).nan_to_num(0).to(torch.int8)
        assert torch.equal(mine, codes), name
        assert torch.equal(scales, absmax), name
        mine_back = (codes.float() * scales.unsqueeze(1)) * torch.tensor(7.874015718698502e-3, dtype=torch.float32)
        assert torch.equal(mine_back, back), name
        print(
            f"{name} {key}: {int((true_div != codes).sum())} codes differ from round(x*127/absmax); "
            f"max |x - back| {float((weight - back).abs().max()):.3g}"
        )
    same = torch.equal(tensors[f"{name}.int8.codes"], tensors[f"{name}.int8_f16.codes"])
    print(f"{name}: f16-cast codes {'equal' if same else 'DIFFER from'} the f32 ones")
assert int(tensors["random.zero_row.int8.codes"][5].abs().sum()) == 0
assert float(tensors["random.zero_row.int8.scales"][5]) == 0.0
# A threshold holds outliers out of the absmax and zeroes their whole columns in the codes
# (activations only: Linear8bitLt quantizes weights with threshold 0).
codes_t, scales_t, cols = F.int8_vectorwise_quant(zero_row.clone(), threshold=0.05)
print(f"threshold 0.05 on random.zero_row: {cols.numel()} outlier columns, "
      f"{int((codes_t != tensors['random.zero_row.int8.codes']).sum())} codes change")
out = f"{qlora_dir}/bnb-int8.safetensors"
save_file(tensors, out, metadata=versions)
print(f"wrote {out}: {len(subjects)} subjects")

# ---------------------------------------------------------------- 2. llama64
folder = f"{qlora_dir}/llama64"
config = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    vocab_size=512,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    initializer_range=0.05,
    dtype="float32",
)
torch.manual_seed(11)
model = LlamaForCausalLM(config).float().eval()
model.save_pretrained(folder)
for extra in ["generation_config.json"]:
    if os.path.exists(f"{folder}/{extra}"):
        os.remove(f"{folder}/{extra}")
assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"], os.listdir(folder)
print(f"wrote {folder}: {sorted(os.listdir(folder))}")

tokens = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(11), dtype=torch.int64)


def logits_of(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float().contiguous()


def float_model(replace=None):
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if replace is not None:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("proj.weight"):
                    parameter.copy_(replace(name, parameter.detach().clone()))
    return model


outputs = {"tokens": tokens, "float.logits": logits_of(float_model())}
for key, kind, double in [("nf4_double", "nf4", True), ("nf4", "nf4", False), ("fp4", "fp4", False)]:
    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=kind,
        bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=torch.float32,
    )
    quantized = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_config, device_map="cpu")
    linears = [m for m in quantized.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    assert len(linears) == 14, len(linears)
    native_bf16 = any(m.support_avx512bf16_for_cpu for m in linears)
    for m in linears:
        assert m.weight.quant_state.blocksize == 64 and m.weight.quant_state.nested == double
        m.support_avx512bf16_for_cpu = False
    # The weights transformers quantized, dequantized by bitsandbytes, against the flat
    # round trip the reference below uses.
    params = dict(quantized.named_parameters())

    def round_trip(name, weight):
        packed, state = F.quantize_4bit(weight.reshape(-1), blocksize=64, quant_type=kind, compress_statistics=double)
        return F.dequantize_4bit(packed, state).float().reshape(weight.shape)

    saved = load_file(f"{folder}/model.safetensors")
    differing = [
        name
        for name, parameter in params.items()
        if name.endswith("proj.weight")
        and not torch.equal(
            F.dequantize_4bit(parameter.data, parameter.quant_state).float(),
            round_trip(name, saved[name]),
        )
    ]
    print(f"{key}: {len(differing)} of 14 loaded weights differ from the flat round trip {differing}")
    logits = logits_of(quantized)
    reference = logits_of(float_model(round_trip))
    outputs[f"{key}.logits"] = logits
    print(f"{key}: max |logits - dequantized float model| {float((logits - reference).abs().max()):.3g}; "
          f"max |logits - float| {float((logits - outputs['float.logits']).abs().max()):.3g}")
    if native_bf16:
        for m in linears:
            m.support_avx512bf16_for_cpu = True
        native = logits_of(quantized)
        print(f"{key}: bitsandbytes' own AVX512-BF16 CPU path differs from the f32 path by "
              f"{float((native - logits).abs().max()):.3g}")

# LLM.int8 (transformers' default llm_int8_threshold, 6.0).
threshold = 6.0
try:
    bnb_config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=threshold)
    quantized = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_config, device_map="cpu")
    linears = {n: m for n, m in quantized.named_modules() if isinstance(m, bitsandbytes.nn.Linear8bitLt)}
    assert len(linears) == 14, len(linears)
    outlier_rows = []
    hooks = [
        m.register_forward_pre_hook(
            lambda m, args: outlier_rows.append(int((args[0].half().abs() >= threshold).any(dim=-1).sum()))
        )
        for m in linears.values()
    ]
    logits = logits_of(quantized)
    for hook in hooks:
        hook.remove()
    outputs["int8.logits"] = logits
    print(f"int8: weight dtype {next(iter(linears.values())).weight.dtype}, "
          f"rows with an activation >= {threshold}: {sum(outlier_rows)}; "
          f"max |logits - float| {float((logits - outputs['float.logits']).abs().max()):.3g}")

    # The same, emulated: weights and activations cast to f16, row-wise int8, integer matmul,
    # then i32 * (SCA x SCB) * 6.200124e-05 in f32; outlier columns in f32 against the
    # dequantized weight columns.
    class Emulated(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.cb, self.scb, _ = F.int8_vectorwise_quant(weight.half())

        def forward(self, x):
            shape = x.shape
            a = x.reshape(-1, shape[-1])
            a16 = a.half()
            outliers = (a16.abs() >= threshold)
            cols = torch.argwhere(outliers.any(dim=0)).view(-1)
            a16 = a16.masked_fill(outliers, 0)
            sca = a16.abs().amax(dim=1).float()
            ca = torch.round(a16 * (sca.reciprocal() * 127.0).unsqueeze(1)).to(torch.int8)
            ca[:, cols] = 0
            acc = (ca.float() @ self.cb.float().t()).to(torch.int32)
            out = acc * (sca.unsqueeze(1) * self.scb.unsqueeze(0)) * 6.200124e-05
            if cols.numel():
                sub_b = (self.cb[:, cols].float() * self.scb.view(-1, 1) * 7.874015718698502e-3).t()
                out = out.addmm(a[:, cols], sub_b)
            return out.reshape(*shape[:-1], -1)

    emulated = float_model()
    for name, module in list(emulated.named_modules()):
        if isinstance(module, torch.nn.Linear) and name.endswith("proj"):
            parent, child = name.rsplit(".", 1)
            setattr(emulated.get_submodule(parent), child, Emulated(module.weight.detach()))
    for name, module in linears.items():
        cb = module.state.CB if module.state.CB is not None else module.weight.data
        assert torch.equal(cb, emulated.get_submodule(name).cb), name
    print(f"int8: max |logits - emulation| {float((logits - logits_of(emulated)).abs().max()):.3g}")
except Exception as error:  # noqa: BLE001 - report what bitsandbytes/transformers said
    print(f"int8: load_in_8bit on the CPU failed: {type(error).__name__}: {error}")



# LLM.int8's weights as bitsandbytes' Int8Params makes them (cast to f16, row-wise int8)
# and `int8_vectorwise_dequant` gives them back: what a Regatta int8 base multiplies by (it
# dequantizes and runs an f32 linear, as bitsandbytes' own CPU training path MatMul8bitFp
# does, up to that path's rounding order code * (absmax * (1/127)), an ulp at most).
def int8_round_trip(name, weight):
    codes, scales, _ = F.int8_vectorwise_quant(weight.half())
    return F.int8_vectorwise_dequant(codes, scales).float().reshape(weight.shape)


outputs["int8_dequantized.logits"] = logits_of(float_model(int8_round_trip))
out = f"{qlora_dir}/llama64-logits.safetensors"
save_file(outputs, out, metadata=versions)
print(f"wrote {out}: {sorted(outputs)}")

# ---------------------------------------------------------------- 3. the int8 base
# The Llama fixture with every projection weight replaced by that int8 round trip: the
# float model an int8 QLoRA run on it must train exactly as (torch/tests/lora.rs).
dequantized = {
    name: (int8_round_trip(name, tensor.float()) if name.endswith("proj.weight") else tensor).contiguous()
    for name, tensor in weights.items()
}
out = f"{qlora_dir}/llama-int8-dequantized.safetensors"
save_file(dequantized, out, metadata={"format": "pt"})
print(f"wrote {out}: {len(dequantized)} tensors")

# ---------------------------------------------------------------- 4. an 8-bit folder
# The Llama fixture as transformers saves it loaded with load_in_8bit: each projection
# as `W` (int8 codes), `W.SCB` (f32 row absmax) and `W.weight_format` (0: row-major); a
# folder Regatta reads as llama-int8-dequantized.safetensors and an int8 QLoRA run takes
# as stored.
folder8 = f"{qlora_dir}/bnb-llama-int8"
quantized = AutoModelForCausalLM.from_pretrained(
    model_dir, quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map="cpu"
)
quantized.save_pretrained(folder8)
for extra in ["generation_config.json"]:
    if os.path.exists(f"{folder8}/{extra}"):
        os.remove(f"{folder8}/{extra}")
saved8 = load_file(f"{folder8}/model.safetensors")
for name, tensor in dequantized.items():
    if name.endswith("proj.weight"):
        back = F.int8_vectorwise_dequant(saved8[name], saved8[name.replace(".weight", ".SCB")]).float()
        assert torch.equal(back, tensor), name
print(f"wrote {folder8}: {sorted(os.listdir(folder8))}; its codes dequantize to llama-int8-dequantized")
