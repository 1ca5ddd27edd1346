#!/usr/bin/env python3
"""The GPU proof's peer side, plain PyTorch + `transformers` (+ `peft`) on the same device
as Regatta, and the arithmetic both sides' figures are read with. Subcommands print one
JSON line each:

  peak     --device D --dtype T              GEMM FLOP/s measured on the device now
  flops    --config C --seq S [--frozen]     training FLOPs per token of a Llama config
  train    --config C --seq S --batch B --steps N --device D --dtype T [--lora-rank R]
  generate --model DIR --prompts P --max-new-tokens N --batch B --device D --dtype T

FLOPs per token: 6 x (parameters outside the embedding table) + 12 x layers x hidden x
seq (attention scores and their use, forward and backward); with a frozen base (LoRA) the
weights' gradients are not computed: 4 x instead of 6 x. Embedding lookups count nothing.
"""
import argparse
import json
import time

import torch
import transformers


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def config_of(path):
    raw = json.load(open(path))
    config = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    return config


def flops_per_token(config, seq, frozen=False):
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    per_layer = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * inter
    dense = layers * per_layer + h * config.vocab_size  # the LM head; not the embedding table
    weights = (4 if frozen else 6) * dense
    return weights + 12 * layers * h * seq


def peak(device, dtype):
    n = 8192 if device.startswith("cuda") else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    best = float("inf")
    for _ in range(10 if device.startswith("cuda") else 3):
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        sync(device)
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * n**3 / best


def memory(device):
    if not device.startswith("cuda"):
        return {}
    return {
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
    }


def train(args):
    device, dtype = args.device, getattr(torch, args.dtype)
    config = config_of(args.config)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    if args.lora_rank:
        import peft
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=args.lora_rank, lora_alpha=32, target_modules=targets))
    if args.checkpointing:
        # Non-reentrant: works with a frozen base whose inputs need no gradient (LoRA).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.startswith("cuda"))
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
    times, losses = [], []
    for step in range(args.steps):
        sync(device)
        start = time.perf_counter()
        # Mixed precision as PyTorch recipes do it: f32 master weights, bf16 compute.
        with torch.autocast(device_type=device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    warm = times[min(args.warmup, len(times) - 1):]
    tokens_per_sec = args.batch * args.seq * len(warm) / sum(warm)
    return {
        "side": "pytorch+transformers" + ("+peft" if args.lora_rank else ""),
        "device": device, "dtype": args.dtype, "seq": args.seq, "batch": args.batch,
        "steps": args.steps, "tokens_per_sec": tokens_per_sec, "loss_first": losses[0],
        "loss_last": losses[-1], "parameters": sum(p.numel() for p in model.parameters()),
        "flops_per_token": flops_per_token(config, args.seq, frozen=bool(args.lora_rank)),
        **memory(device),
    }


def generate(args):
    device, dtype = args.device, getattr(torch, args.dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts) if line.strip()]
    generated = 0
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), args.batch):
            batch = tokenizer(prompts[i:i + args.batch], return_tensors="pt", padding=True).to(device)
            out = model.generate(
                **batch, do_sample=False, max_new_tokens=args.max_new_tokens,
                min_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
            )
            generated += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    sync(device)
    secs = time.perf_counter() - start
    return {
        "side": "transformers.generate", "device": device, "dtype": args.dtype, "batch": args.batch,
        "rows": len(prompts), "output_tokens": generated, "secs": secs, "output_tokens_per_sec": generated / secs,
        **memory(device),
    }


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("peak")
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="float32")
    s = sub.add_parser("flops")
    s.add_argument("--config", required=True)
    s.add_argument("--seq", type=int, required=True)
    s.add_argument("--frozen", action="store_true")
    s = sub.add_parser("train")
    for name, kind, default in [("--config", str, None), ("--seq", int, 128), ("--batch", int, 1), ("--steps", int, 10),
                                ("--device", str, "cpu"), ("--dtype", str, "float32"), ("--lora-rank", int, 0),
                                ("--warmup", int, 3)]:
        s.add_argument(name, type=kind, default=default)
    s.add_argument("--checkpointing", action="store_true")
    s = sub.add_parser("generate")
    for name, kind, default in [("--model", str, None), ("--prompts", str, None), ("--max-new-tokens", int, 32),
                                ("--batch", int, 1), ("--device", str, "cpu"), ("--dtype", str, "float32")]:
        s.add_argument(name, type=kind, default=default)
    args = p.parse_args()
    if args.what == "peak":
        dtype = getattr(torch, args.dtype)
        result = {"device": args.device, "dtype": args.dtype, "gemm_flops_per_sec": peak(args.device, dtype)}
        if args.device.startswith("cuda"):
            result["name"] = torch.cuda.get_device_name(0)
    elif args.what == "flops":
        result = {"flops_per_token": flops_per_token(config_of(args.config), args.seq, args.frozen)}
    elif args.what == "train":
        result = train(args)
    else:
        result = generate(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
