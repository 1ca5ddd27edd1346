#!/usr/bin/env python3
"""QLoRA fixtures made by bitsandbytes on the CPU (torch/tests/qlora.rs checks Regatta's
4-bit quantization against them bit for bit).

For the Llama fixture's projection weights and two random tensors (one whose length is
not a multiple of the block, one with more than 256 blocks so double quantization has two
nested blocks), bitsandbytes' `quantize_4bit` in NF4 and FP4, blocksize 64, with and
without double quantization (`compress_statistics`): the packed codes, the absmax values
(or their 8-bit codes, the nested absmax and the offset), and `dequantize_4bit`'s f32
result. Also bitsandbytes' dynamic 8-bit map.

Run with a python holding torch and bitsandbytes (0.50):
    python scripts/make-qlora-fixtures.py torch/tests/fixtures/llama torch/tests/fixtures/qlora/bnb.safetensors
"""
import sys

import bitsandbytes
import bitsandbytes.functional as F
import torch
from safetensors.torch import load_file, save_file

model_dir, out = sys.argv[1], sys.argv[2]
weights = {}
import glob
for path in sorted(glob.glob(f"{model_dir}/*.safetensors")):
    if "model" in path.split("/")[-1]:
        weights.update(load_file(path))
subjects = {
    name: tensor.float()
    for name, tensor in weights.items()
    if name.startswith("model.layers.0.") and name.endswith("proj.weight")
}
generator = torch.Generator().manual_seed(7)
subjects["random.odd"] = torch.randn(1000, generator=generator) * 0.05
subjects["random.many"] = torch.randn(300, 64, generator=generator) * 0.02

tensors = {"dynamic_map": F.create_dynamic_map().float().contiguous()}
for name, weight in subjects.items():
    tensors[f"{name}.input"] = weight.contiguous()
    for kind in ["nf4", "fp4"]:
        for double in [False, True]:
            key = f"{name}.{kind}.{'double' if double else 'plain'}"
            # Flat, as the kernels quantize anyway: bitsandbytes 0.50's CPU dequantize of a
            # 2-D weight whose rows are not a multiple of the block (down_proj, 160 wide)
            # reads the wrong absmax (its C++ kernel indexes absmax by row); the flat
            # tensor dequantizes as the CUDA kernel does any shape.
            packed, state = F.quantize_4bit(weight.reshape(-1), blocksize=64, quant_type=kind, compress_statistics=double)
            tensors[f"{key}.packed"] = packed.reshape(-1).contiguous()
            if double:
                tensors[f"{key}.absmax"] = state.absmax.reshape(-1).contiguous()
                tensors[f"{key}.nested_absmax"] = state.state2.absmax.float().reshape(-1).contiguous()
                tensors[f"{key}.offset"] = state.offset.float().reshape(1).contiguous()
            else:
                tensors[f"{key}.absmax"] = state.absmax.float().reshape(-1).contiguous()
            tensors[f"{key}.dequantized"] = F.dequantize_4bit(packed, state).float().reshape(-1).contiguous()
save_file(tensors, out, metadata={"bitsandbytes": bitsandbytes.__version__, "torch": torch.__version__})
print(f"wrote {out}: {len(subjects)} tensors, bitsandbytes {bitsandbytes.__version__}")

# The whole Llama fixture with every projection weight replaced by bitsandbytes' NF4
# (double quantization, blocksize 64) round trip: the float model a QLoRA run on that base
# must train exactly as (torch/tests/qlora.rs's reference).
dequantized = {}
for name, tensor in weights.items():
    if name.endswith("proj.weight"):
        flat = tensor.float().reshape(-1)
        packed, state = F.quantize_4bit(flat, blocksize=64, quant_type="nf4", compress_statistics=True)
        dequantized[name] = F.dequantize_4bit(packed, state).float().reshape(tensor.shape).contiguous()
    else:
        dequantized[name] = tensor.contiguous()
dequantized_out = out.replace("bnb.safetensors", "llama-nf4-dequantized.safetensors")
save_file(dequantized, dequantized_out, metadata={"format": "pt"})
print(f"wrote {dequantized_out}: {len(dequantized)} tensors")

# The Llama fixture as transformers saves it quantized by bitsandbytes (NF4, double
# quantization): a folder Regatta reads as the float model bitsandbytes' dequantization
# gives (torch/tests/qlora.rs compares it with llama-nf4-dequantized.safetensors).
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

bnb_config = BitsAndBytesConfig(
    load_in_4bit=True,
    bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=torch.float32,
)
quantized = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=bnb_config, device_map="cpu")
folder = out.replace("bnb.safetensors", "bnb-llama")
quantized.save_pretrained(folder)
import os
for extra in ["generation_config.json"]:
    if os.path.exists(f"{folder}/{extra}"):
        os.remove(f"{folder}/{extra}")
print(f"wrote {folder}: {sorted(os.listdir(folder))}")
