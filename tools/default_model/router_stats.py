#!/usr/bin/env python3
"""Per-layer router decisiveness over models/default/heldout.txt (CPU, f32): mean probability of the
top-1 and top-2 experts and the mean router entropy relative to the uniform log(E). Adds these as
"decisiveness" to expert_load.json (whose load histogram train.py computed on the GPU)."""
import json
import math
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

d = sys.argv[1] if len(sys.argv) > 1 else "models/default"
tok = AutoTokenizer.from_pretrained(d)
m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
ids = tok(open(f"{d}/heldout.txt").read())["input_ids"]
E = m.config.num_experts
acc = None
n = 0
with torch.no_grad():
    for i in range(0, len(ids) - 1, 512):
        o = m(torch.tensor([ids[i:i + 512]]), output_router_logits=True)
        rows = []
        for rl in o.router_logits:
            p = rl.float().softmax(-1)
            s = p.sort(-1, descending=True).values
            ent = -(p * p.clamp_min(1e-12).log()).sum(-1) / math.log(E)
            rows.append(torch.stack([s[:, 0].sum(), s[:, :2].sum(), ent.sum()]))
        r = torch.stack(rows)
        acc = r if acc is None else acc + r
        n += len(ids[i:i + 512])
acc = (acc / n).tolist()
path = f"{d}/expert_load.json"
e = json.load(open(path))
e["decisiveness"] = {
    "description": "per layer, over the same held-out tokens: mean router probability of the top-1 expert, "
                   "of the top-2 together, and mean router entropy / log(num_experts) (1.0 = uniform router; "
                   "a uniform router would give top1 = 1/16 = 0.0625, top2 = 0.125)",
    "top1_prob": [round(r[0], 4) for r in acc], "top2_prob": [round(r[1], 4) for r in acc],
    "normalized_entropy": [round(r[2], 4) for r in acc]}
json.dump(e, open(path, "w"), indent=1)
for li, r in enumerate(acc):
    print(f"layer {li}: top1 {r[0]:.3f}  top2 {r[1]:.3f}  entropy/log(E) {r[2]:.3f}")
