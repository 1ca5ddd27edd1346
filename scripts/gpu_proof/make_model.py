#!/usr/bin/env python3
"""Writes a randomly initialised Llama-family model as a Hugging Face folder, for the GPU
proof's generation and LoRA steps: `config.json` from --config, weights by `transformers`'
own initialisation (seeded) in --dtype, and a tokenizer (tokenizer.json from --tokenizer)
with no end-of-sequence token, so that every row generates exactly max_new_tokens on both
sides of a throughput comparison."""
import argparse
import json
import pathlib
import shutil

import torch
import transformers

p = argparse.ArgumentParser()
p.add_argument("--config", required=True)
p.add_argument("--tokenizer", required=True, help="a tokenizer.json")
p.add_argument("--out", required=True)
p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
p.add_argument("--device", default="cpu")
args = p.parse_args()

out = pathlib.Path(args.out)
out.mkdir(parents=True, exist_ok=True)
raw = json.loads(pathlib.Path(args.config).read_text())
raw.update({"eos_token_id": None, "bos_token_id": None, "pad_token_id": None})
config = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
config.architectures = ["LlamaForCausalLM"]
torch.manual_seed(0)
with torch.device(args.device):
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, args.dtype))
model.generation_config.eos_token_id = None
model.save_pretrained(out, safe_serialization=True)
(out / "generation_config.json").unlink(missing_ok=True)
shutil.copy(args.tokenizer, out / "tokenizer.json")
(out / "tokenizer_config.json").write_text(
    json.dumps({"add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"})
)
n = sum(t.numel() for t in model.parameters())
print(json.dumps({"model": str(out), "parameters": n, "dtype": args.dtype}))
