#!/usr/bin/env python3
"""Append to models/default/samples.txt sampled continuations with the shipped generation defaults
(T=0.8, top_p=0.95, top_k=40, repetition_penalty=1.1), computed here on the CPU in f32."""
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

d = sys.argv[1] if len(sys.argv) > 1 else "models/default"
t = AutoTokenizer.from_pretrained(d)
m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
prompts = [("plain", "Once upon a time"), ("plain", "The little robot"), ("plain", "One day, Tom and his dog"),
           ("chat", "Write a short story for children about a bear who finds a magic key in a big forest."),
           ("chat", "Tell me a bedtime story about a brave little mouse."), ("chat", "Why is the sky blue?")]
out = ["", "#" * 80, "# The same prompts with the shipped generation_config (adds repetition_penalty=1.1),",
       "# sampled on the CPU with transformers in f32, seed 7, at most 200 new tokens.", "#" * 80, ""]
for kind, p in prompts:
    text = p if kind == "plain" else t.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                           add_generation_prompt=True)
    x = t(text, return_tensors="pt", add_special_tokens=False).input_ids
    torch.manual_seed(7)
    o = m.generate(x, do_sample=True, temperature=0.8, top_p=0.95, top_k=40, repetition_penalty=1.1,
                   max_new_tokens=200, eos_token_id=[2, 0], pad_token_id=0)
    out.append(f"=== [{kind}] {p}\n--- sampled (T=0.8, top_p=0.95, top_k=40, repetition_penalty=1.1):\n"
               f"{t.decode(o[0, x.shape[1]:], skip_special_tokens=True).strip()}\n")
open(f"{d}/samples.txt", "a").write("\n".join(out))
print("\n".join(out))
