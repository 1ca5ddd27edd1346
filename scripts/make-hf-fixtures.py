#!/usr/bin/env python3
"""Makes the Hugging Face fixtures that prove Regatta's Llama-family models equal
`transformers`: three randomly initialised models (Llama with Llama 3 rope scaling and
sharded weights, Mistral, Qwen2 with q/k/v biases and tied embeddings; 2 layers, width 64,
fewer KV heads than query heads, the 512-token tokenizer in data/), each saved with
`save_pretrained`, plus `reference.safetensors`: fixed token ids, labels (some -100), the
logits, the loss and the gradient of every parameter after one backward, all in float32.

Run once where `torch` and `transformers` are installed; the output is committed under
torch/tests/fixtures/ and the tests need no Python:

    python3 -m venv ~/.cache/regatta/fixture-venv
    ~/.cache/regatta/fixture-venv/bin/pip install torch==2.11.0 transformers safetensors
    ~/.cache/regatta/fixture-venv/bin/python scripts/make-hf-fixtures.py

`--check-load DIR` instead loads a checkpoint Regatta wrote with `from_pretrained` and
prints its logits' digest for the fixture's token ids (the note of issue 14 says where this
ran).
"""
import argparse
import json
import pathlib
import shutil

import torch
import transformers
from safetensors.torch import save_file

root = pathlib.Path(__file__).resolve().parent.parent
out_root = root / "torch" / "tests" / "fixtures"

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

MODELS = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
        "60KB",  # several shards and an index
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(num_key_value_heads=1, tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None),
        None,
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False),
        None,
    ),
}


def token_ids():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, COMMON["vocab_size"], (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt: no loss on these
    return ids, labels


def make(name, config_class, model_class, extra, shard):
    torch.manual_seed(1234)
    config = config_class(**COMMON, **extra)
    config._attn_implementation = "eager"
    model = model_class(config).float()
    # Norm weights and biases start at ones / zeros: randomise them so a swapped or
    # ignored norm or bias shows in the logits.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in pname else 0.0))
    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, **kwargs)
    shutil.copy(root / "data" / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=2))
    ids, labels = token_ids()
    model.train()
    result = model(input_ids=ids, labels=labels)
    result.loss.backward()
    tensors = {
        "input_ids": ids,
        "labels": labels,
        "logits": result.logits.detach().float().contiguous(),
        "loss": result.loss.detach().float().reshape(1),
    }
    for pname, p in model.named_parameters():
        tensors[f"grad.{pname}"] = p.grad.detach().float().contiguous()
    save_file(tensors, out / "reference.safetensors")
    files = sorted(p.name for p in out.iterdir())
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, loss {result.loss.item():.6f}, files {files}")


def check_load(directory):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    ids, _ = token_ids()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    print(json.dumps({"loaded": str(directory), "class": type(model).__name__,
                      "logits_sum": logits.sum().item(), "logits_abs_sum": logits.abs().sum().item()}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--check-load")
    args = parser.parse_args()
    if args.check_load:
        check_load(args.check_load)
    else:
        print(f"transformers {transformers.__version__}, torch {torch.__version__}")
        for name, (cc, mc, extra, shard) in MODELS.items():
            make(name, cc, mc, extra, shard)
