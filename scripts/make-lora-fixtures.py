#!/usr/bin/env python3
"""Makes the LoRA fixtures that prove Regatta's adapters equal `peft`'s: for the Llama and
Qwen2 fixtures of scripts/make-hf-fixtures.py, a PEFT LoRA adapter saved with
`save_pretrained` (adapter_config.json + adapter_model.safetensors, PEFT's names and
layout) whose A and B matrices are random (PEFT starts B at zero, which would make the
adapter a no-op), plus `lora-reference.safetensors`: fixed token ids, the PEFT model's
logits (base + adapter, unmerged) and the logits of `merge_and_unload()`'s model.

    Llama: every projection, r = 4, alpha = 8.
    Qwen2 (q/k/v biases, tied embeddings): q_proj and v_proj only, r = 2, alpha = 4, rsLoRA.

Run once where `torch`, `transformers` and `peft` are installed; the output is committed
under torch/tests/fixtures/*-lora/ and the tests need no Python:

    ~/.cache/regatta/fixture-venv/bin/pip install torch==2.11.0 transformers safetensors peft
    ~/.cache/regatta/fixture-venv/bin/python scripts/make-lora-fixtures.py

`--check-load STEP_DIR` instead loads a LoRA checkpoint Regatta wrote (with
`merge_on_save`) twice: its adapter with `PeftModel.from_pretrained` on the base its
adapter_config.json names, and its merged weights (STEP_DIR/merged) with
`from_pretrained`; it prints the
largest difference of their logits on fixed token ids (the note of issue 16 says where
this ran).

`--check-qlora STEP_DIR` loads a QLoRA checkpoint's adapter (a run with
`base_quantization`) with `PeftModel.from_pretrained` on its base as bitsandbytes holds it
in 4 bits (the base folder already 4-bit, or quantized at load with the run's settings
from its adapter_config.json's base and `--quant nf4|fp4 [--double]`), and prints the
adapter's effect on the logits and how far they are from the same adapter on the float
base given by `--float-base DIR` (bitsandbytes' dequantization of it), if given.
"""
import argparse
import json
import pathlib

import peft
import torch
import transformers
from safetensors.torch import save_file

root = pathlib.Path(__file__).resolve().parent.parent
fixtures = root / "torch" / "tests" / "fixtures"

ADAPTERS = {
    "llama": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "qwen2": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_rslora=True),
}


def check_load(step_dir):
    step = pathlib.Path(step_dir)
    base_path = json.loads((step / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, step).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(step / "merged", dtype=torch.float32).eval()
    ids = torch.randint(3, base.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a = with_adapter(input_ids=ids).logits
        b = merged(input_ids=ids).logits
        with with_adapter.disable_adapter():
            plain = with_adapter(input_ids=ids).logits
    print(f"peft adapter vs merged weights: max |logits difference| = {(a - b).abs().max().item():.3e}")
    print(f"adapter effect: max |adapter - base| = {(a - plain).abs().max().item():.3e}")


def check_qlora(step_dir, quant, double, float_base):
    step = pathlib.Path(step_dir)
    base_path = json.loads((step / "adapter_config.json").read_text())["base_model_name_or_path"]
    config = json.loads((pathlib.Path(base_path) / "config.json").read_text())
    kwargs = {}
    if "quantization_config" not in config:
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant,
            bnb_4bit_use_double_quant=double,
            bnb_4bit_compute_dtype=torch.float32,
        )
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, device_map="cpu", **kwargs)
    kinds = sorted({type(m).__name__ for m in base.modules() if "4bit" in type(m).__name__})
    with_adapter = peft.PeftModel.from_pretrained(base, step).eval()
    ids = torch.randint(3, base.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a = with_adapter(input_ids=ids).logits
        with with_adapter.disable_adapter():
            plain = with_adapter(input_ids=ids).logits
    print(f"peft loaded the adapter on a 4-bit base ({', '.join(kinds) or 'no 4-bit layers!'})")
    print(f"adapter effect: max |adapter - base| = {(a - plain).abs().max().item():.3e}")
    if float_base:
        reference = transformers.AutoModelForCausalLM.from_pretrained(float_base, dtype=torch.float32)
        reference = peft.PeftModel.from_pretrained(reference, step).eval()
        with torch.no_grad():
            b = reference(input_ids=ids).logits
        print(f"4-bit base vs its float dequantization, same adapter: max |logits difference| = {(a - b).abs().max().item():.3e}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check-load", metavar="STEP_DIR")
    parser.add_argument("--check-qlora", metavar="STEP_DIR")
    parser.add_argument("--quant", default="nf4")
    parser.add_argument("--double", action="store_true")
    parser.add_argument("--float-base", metavar="DIR")
    args = parser.parse_args()
    if args.check_load:
        check_load(args.check_load)
        return
    if args.check_qlora:
        check_qlora(args.check_qlora, args.quant, args.double, args.float_base)
        return
    for name, settings in ADAPTERS.items():
        base = fixtures / name
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model.eval()
        config = peft.LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **settings)
        lora = peft.get_peft_model(model, config)
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for param_name, param in lora.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.05)
        out = fixtures / f"{name}-lora"
        out.mkdir(exist_ok=True)
        # base_model_name_or_path as the repository names the base.
        lora.peft_config["default"].base_model_name_or_path = f"torch/tests/fixtures/{name}"
        lora.save_pretrained(out)
        ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            logits = lora(input_ids=ids).logits
            base_logits = lora.get_base_model()
            with lora.disable_adapter():
                base_logits = lora(input_ids=ids).logits
            merged = lora.merge_and_unload()(input_ids=ids).logits
        save_file(
            {
                "input_ids": ids.contiguous(),
                "logits": logits.contiguous(),
                "base_logits": base_logits.contiguous(),
                "merged_logits": merged.contiguous(),
            },
            out / "lora-reference.safetensors",
        )
        print(out, "max |lora - base| =", (logits - base_logits).abs().max().item())


if __name__ == "__main__":
    main()
