"""Makes scorer/tests/fixtures/sampling.json: logits rows and, for several (temperature,
top_k, top_p) settings, the distribution `transformers`' own logits warpers leave
(TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, applied in generate's order,
then softmax). Regatta's sampler must keep the same tokens with the same probabilities.

  ~/.cache/regatta/torch-venv/bin/python scripts/make-sampling-fixtures.py
"""
import json
import os

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

torch.manual_seed(11)
vocab = 2000
rows = [torch.randn(vocab) * scale for scale in (1.0, 3.0, 8.0)]
# A row with ties and a long flat tail.
tied = torch.full((vocab,), -4.0)
tied[:10] = torch.tensor([5.0, 5.0, 4.0, 4.0, 4.0, 3.0, 2.0, 2.0, 1.0, 0.5])
rows.append(tied)
# Four decimals, so the file is small and both sides read the same numbers.
rows = [torch.tensor([round(v, 4) for v in r.tolist()], dtype=torch.float64) for r in rows]
settings = [(1.0, 0, 0.9), (0.7, 0, 0.95), (1.3, 50, 1.0), (0.8, 40, 0.8), (1.0, 0, 0.5), (2.0, 0, 0.99)]
cases = []
skipped = 0
for t, k, p in settings:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(t)])
    if k:
        warpers.append(TopKLogitsWarper(k))
    if p < 1.0:
        warpers.append(TopPLogitsWarper(p))
    for i, logits in enumerate(rows):
        warped = warpers(torch.zeros(1, 1, dtype=torch.long), logits.clone().unsqueeze(0))[0]
        probs = torch.softmax(warped, -1)
        kept = torch.nonzero(probs > 0).flatten().tolist()
        # A nucleus cut inside a run of equal logits is decided by the sort's order of the
        # ties, which no two implementations need to share: such cases are left out.
        if p < 1.0:
            edge = min(logits[j].item() for j in kept)
            if any(logits[j].item() == edge for j in range(vocab) if j not in set(kept)):
                skipped += 1
                continue
        cases.append({"row": i, "temperature": t, "top_k": k, "top_p": p,
                      "tokens": kept, "probs": [float(f"{probs[j].item():.7g}") for j in kept]})
out = os.path.join(os.path.dirname(__file__), "..", "scorer", "tests", "fixtures", "sampling.json")
json.dump({"logits": [r.tolist() for r in rows], "cases": cases}, open(out, "w"))
print(f"wrote {out}: {len(rows)} rows x {len(settings)} settings, {skipped} cut inside ties left out")
