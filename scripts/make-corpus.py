#!/usr/bin/env python3
"""Builds data/corpus.txt (training text) and data/eval.jsonl (held-out rows to score)
from the docstrings of Python's standard library (Python Software Foundation License),
so the main job trains on real English without any download. Run once; the outputs are
committed. Deterministic for a given Python version."""
import inspect
import json
import pathlib
import re

MODULES = ["collections", "itertools", "functools", "json", "string", "textwrap", "random",
           "statistics", "re", "pathlib", "datetime", "heapq", "bisect", "argparse", "logging",
           "subprocess", "threading", "queue", "shutil", "tempfile", "csv", "decimal",
           "fractions", "difflib", "enum", "dataclasses", "typing", "contextlib", "io", "os"]


def paragraphs():
    seen = set()
    for name in MODULES:
        module = __import__(name)
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if (inspect.isfunction(obj) or inspect.isclass(obj)) else None
            if not doc:
                continue
            for para in doc.split("\n\n"):
                text = re.sub(r"\s+", " ", para).strip()
                if len(text) < 60 or not text[0].isalpha() or ">>>" in text or text in seen:
                    continue
                if sum(c.isascii() for c in text) != len(text):
                    continue
                seen.add(text)
                yield text


def main():
    root = pathlib.Path(__file__).resolve().parent.parent / "data"
    root.mkdir(exist_ok=True)
    texts = list(paragraphs())
    held_out = [t for i, t in enumerate(texts) if i % 10 == 0]
    train = [t for i, t in enumerate(texts) if i % 10 != 0]
    (root / "corpus.txt").write_text("\n".join(train) + "\n")
    with open(root / "eval.jsonl", "w") as out:
        for i, text in enumerate(held_out):
            out.write(json.dumps({"id": f"eval-{i:04d}", "text": text}) + "\n")
    print(f"corpus.txt: {sum(len(t) + 1 for t in train)} bytes; eval.jsonl: {len(held_out)} rows")


if __name__ == "__main__":
    main()
