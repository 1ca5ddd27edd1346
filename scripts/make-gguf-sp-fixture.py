#!/usr/bin/env python3
"""Makes the fixture that proves Regatta builds the tokenizer of a GGUF file with a
SentencePiece-style vocabulary (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral v0.1-0.3,
TinyLlama) as `transformers` does. Output under torch/tests/fixtures/gguf/ (committed; the
tests need no Python):

- `sp-tokenizer.gguf`: a small vocabulary laid out as llama.cpp writes a SentencePiece BPE
  model: `<unk>` (UNKNOWN), `<s>` and `</s>` (CONTROL), the 256 byte pieces `<0x00>`..`<0xFF>`
  (BYTE), the pieces of a BPE trained here on a few sentences (NORMAL, scored by merge
  order like a SentencePiece model, single characters last), one USER_DEFINED token and
  one more CONTROL token. No merges are stored (llama.cpp stores none for this model), so
  the merges come from the scores. No tensors.
- `sp-tokenizer.json`: `tokenizer`, the `tokenizer.json` transformers builds from that file
  (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), and `samples`: texts with the ids
  it gives each (add_special_tokens=False) and the text it decodes those ids to.

Run where transformers 5.24 and gguf are installed:

    PYTHONPATH=/tmp/ggufsrc ~/.cache/regatta/torch-venv/bin/python scripts/make-gguf-sp-fixture.py
"""
import collections
import json
import pathlib

import gguf
import transformers

root = pathlib.Path(__file__).resolve().parent.parent
out = root / "torch" / "tests" / "fixtures" / "gguf"
GGUF_NAME = "sp-tokenizer.gguf"

CORPUS = """the quick brown fox jumps over the lazy dog
then the other fox ran into the forest and the dog followed them
in the beginning there was nothing but the sea and the sky
she sells sea shells on the sea shore, the shells she sells are surely sea shells
a café serves coffee to the people who come in the morning
Hello, World! Hello again, world. This is a test of the tokenizer
training a tokenizer on a tiny text is enough to test it"""

MERGES = 120
USER_DEFINED = "<think>"
CONTROL = "[INST]"

SAMPLES = [
    "the quick brown fox jumps over the lazy dog",
    " leading space and  two  spaces   three",
    "Hello, World!\nNew line\n\nend\n",
    "café naïve 日本 🚀 zebra",
    "<think>the answer</think> [INST] hi [INST]",
    "\ttab, UPPER case, 12345 digits",
    "",
    "   ",
]


def train_bpe(text, merges):
    """SentencePiece-style BPE: spaces become `▁` and start each word; pieces in merge order."""
    words = collections.Counter("\u2581" + w for line in text.splitlines() for w in line.split(" ") if w)
    chars = collections.Counter()
    for word, n in words.items():
        for c in word:
            chars[c] += n
    split = {word: list(word) for word in words}
    pieces = []
    for _ in range(merges):
        pairs = collections.Counter()
        for word, n in words.items():
            parts = split[word]
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        pieces.append(a + b)
        for word in words:
            parts, merged, i = split[word], [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            split[word] = merged
    singles = [c for c, _ in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0]))]
    # The run of spaces real vocabularies hold (Llama 2 has `▁▁` and longer).
    return pieces + ["\u2581\u2581", "\u2581\u2581\u2581\u2581"], singles


def write_gguf(path):
    pieces, singles = train_bpe(CORPUS, MERGES)
    T = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
    scores = [0.0] * len(tokens)
    for i, piece in enumerate(pieces + singles):
        tokens.append(piece)
        types.append(T.NORMAL)
        scores.append(-float(i))
    for token, kind in [(USER_DEFINED, T.USER_DEFINED), (CONTROL, T.CONTROL)]:
        tokens.append(token)
        types.append(kind)
        scores.append(0.0)
    assert len(set(tokens)) == len(tokens), "a token twice"

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return len(tokens)


def main():
    out.mkdir(parents=True, exist_ok=True)
    count = write_gguf(out / GGUF_NAME)
    tok = transformers.AutoTokenizer.from_pretrained(str(out), gguf_file=GGUF_NAME)
    samples = []
    for text in SAMPLES:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        samples.append({"text": text, "ids": ids, "decoded": tok.decode(ids)})
    fixture = {
        "transformers": transformers.__version__,
        "tokenizer": json.loads(tok.backend_tokenizer.to_str()),
        "samples": samples,
    }
    path = out / "sp-tokenizer.json"
    path.write_text(json.dumps(fixture, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"{count} tokens; wrote {out / GGUF_NAME} and {path}")
    for s in samples:
        print(repr(s["text"]), s["ids"], repr(s["decoded"]))


if __name__ == "__main__":
    main()
