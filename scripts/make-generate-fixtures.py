#!/usr/bin/env python3
"""Makes the generation fixtures that prove Regatta's KV-cache generation equals
`transformers`' own `generate` (greedy, with its KV cache): for each model of
torch/tests/fixtures (made by make-hf-fixtures.py), prompts of several lengths are
continued one at a time, and `generate.safetensors` beside the model keeps, for prompt i,
`prompt.i` (the token ids), `tokens.i` (the generated ids, an end-of-sequence token
included when one came) and `scores.i` (the logits each token was chosen from, float32).

Run once where `torch` and `transformers` are installed (see make-hf-fixtures.py for the
venv); the output is committed and the tests need no Python:

    ~/.cache/regatta/fixture-venv/bin/python scripts/make-generate-fixtures.py
"""
import pathlib

import torch
import transformers
from safetensors.torch import save_file

root = pathlib.Path(__file__).resolve().parent.parent
fixtures = root / "torch" / "tests" / "fixtures"

PROMPT_LENGTHS = [3, 11, 29, 50]
MAX_NEW_TOKENS = 16


def make(name):
    folder = fixtures / name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    g = torch.Generator().manual_seed(11)
    tensors = {}
    for i, length in enumerate(PROMPT_LENGTHS):
        prompt = torch.randint(3, model.config.vocab_size, (1, length), generator=g)
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                eos_token_id=model.config.eos_token_id,
                pad_token_id=0,
                use_cache=True,
                output_logits=True,
                return_dict_in_generate=True,
            )
        generated = out.sequences[0, length:]
        logits = torch.stack([s[0] for s in out.logits]).float()
        tensors[f"prompt.{i}"] = prompt[0].contiguous()
        tensors[f"tokens.{i}"] = generated.contiguous()
        tensors[f"scores.{i}"] = logits.contiguous()
        print(f"{name} prompt {i} ({length} tokens): {generated.tolist()}")
    save_file(tensors, folder / "generate.safetensors")


if __name__ == "__main__":
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for name in ["llama", "mistral", "qwen2"]:
        make(name)
