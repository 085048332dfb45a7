#!/usr/bin/env python3
"""Train moerun's embedded default model (a tiny qwen3_moe) on the distilled corpus.

Steps: split the corpus (2% held out), train a byte-level BPE tokenizer, build
the training stream (plain stories + ChatML request->story pairs), train
Qwen3MoeForCausalLM from scratch with the router load-balancing loss for a
fixed wall-clock budget (cosine LR over the step count that budget allows),
then evaluate (val loss, held-out perplexity, per-layer expert load), sample,
and export with save_pretrained (bf16 safetensors, shards <= 15 MB).

GPU:  python3 train.py --corpus corpus.jsonl --out export_dir --minutes 7
CPU smoke test: python3 train.py --corpus c.jsonl --out /tmp/x --minutes 0.5 \
    --device cpu --batch 4 --seq 128 --vocab 600
"""
import argparse
import json
import math
import os
import random
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (GenerationConfig, PreTrainedTokenizerFast, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SAMPLE_PROMPTS = [
    ("plain", "Once upon a time"),
    ("plain", "The little robot"),
    ("plain", "One day, Tom and his dog"),
    ("plain", "Lily wanted to fly a kite, but"),
    ("chat", "Write a short story for children about a bear who finds a magic key in a big forest."),
    ("chat", "Tell me a bedtime story about a brave little mouse."),
]


def log(*a):
    print(*a, flush=True)


def chat_text(prompt, answer=None):
    s = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    if answer is not None:
        s += f"{answer}<|im_end|>\n"
    return s


def train_tokenizer(texts, vocab):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tr = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, min_frequency=2,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                             show_progress=False)
    tok.train_from_iterator(texts, tr)
    return tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=7.0, help="wall-clock budget of the training loop")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--aux", type=float, default=0.02, help="coefficient of the per-layer balance loss")
    ap.add_argument("--chat-frac", type=float, default=0.3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--moe-inter", type=int, default=144)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t_start = time.time()
    os.makedirs(a.out, exist_ok=True)
    rng = random.Random(a.seed)
    torch.manual_seed(a.seed)
    dev = a.device

    # ---------------- corpus ----------------
    seen, items = set(), []
    for line in open(a.corpus):
        d = json.loads(line)
        if d["text"] in seen:
            continue
        seen.add(d["text"])
        items.append(d)
    rng.shuffle(items)
    n_val = max(1, int(0.02 * len(items)))
    val_items, train_items = items[:n_val], items[n_val:]
    log(f"corpus: {len(items)} unique docs ({len(train_items)} train / {len(val_items)} held out)")

    # held-out plain-text file for perplexity checks (~40 KB, stories only)
    held, size = [], 0
    for d in val_items:
        if d["kind"] != "story":
            continue
        held.append(d["text"])
        size += len(d["text"]) + 2
        if size > 40000:
            break
    heldout_text = "\n\n".join(held) + "\n"
    with open(os.path.join(a.out, "heldout.txt"), "w") as f:
        f.write(heldout_text)

    # ---------------- tokenizer ----------------
    t0 = time.time()
    tok = train_tokenizer((d["prompt"] + "\n" + d["text"] for d in train_items), a.vocab)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}, ids
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>", bos_token=None,
                                     unk_token=None, additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
                                     clean_up_tokenization_spaces=False, model_max_length=1024)
    hf_tok.chat_template = CHATML
    hf_tok.save_pretrained(a.out)
    # transformers 5 writes the template to chat_template.jinja; keep it in tokenizer_config.json as well
    tc_path = os.path.join(a.out, "tokenizer_config.json")
    tc = json.load(open(tc_path))
    tc["chat_template"] = CHATML
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # v5 writes "TokenizersBackend", unknown to v4
    json.dump(tc, open(tc_path, "w"), indent=2)
    log(f"tokenizer: vocab {tok.get_vocab_size()} trained in {time.time()-t0:.1f}s")

    # ---------------- data ----------------
    EOT = ids["<|endoftext|>"]

    def docs(its, r):
        out = []
        for d in its:
            if d["kind"] == "qa" or r.random() < a.chat_frac:
                out.append(chat_text(d["prompt"], d["text"]))
            else:
                out.append(d["text"])
        return out

    def encode(texts):
        encs = tok.encode_batch(texts, add_special_tokens=False)
        stream, starts = [], []
        for e in encs:
            starts.append(len(stream))
            stream.extend(e.ids)
            stream.append(EOT)
        return torch.tensor(stream, dtype=torch.int32), torch.tensor(starts, dtype=torch.int64)

    t0 = time.time()
    train_stream, train_starts = encode(docs(train_items, rng))
    val_stream, _ = encode(docs(val_items, random.Random(1)))
    log(f"tokens: train {train_stream.numel()}  val {val_stream.numel()}  "
        f"(chars/token {sum(len(d['text']) for d in train_items)/train_stream.numel():.2f}; {time.time()-t0:.1f}s)")
    train_starts = train_starts[train_starts < train_stream.numel() - a.seq - 1]
    train_stream = train_stream.to(dev).long()
    train_starts = train_starts.to(dev)
    n_vb = min(64, (val_stream.numel() - 1) // a.seq // max(1, a.batch // 2) * max(1, a.batch // 2))
    val_rows = val_stream[: n_vb * a.seq + 1]
    val_x = torch.stack([val_rows[i * a.seq:(i + 1) * a.seq] for i in range(n_vb)]).long()
    val_y = torch.stack([val_rows[i * a.seq + 1:(i + 1) * a.seq + 1] for i in range(n_vb)]).long()
    ar = torch.arange(a.seq + 1, device=dev)

    def get_batch():
        # rows begin at document starts (so a prompt at position 0 looks like training) and run on
        # through the following documents
        s = train_starts[torch.randint(0, train_starts.numel(), (a.batch,), device=dev)]
        rows = train_stream[s[:, None] + ar[None, :]]
        return rows[:, :-1], rows[:, 1:]

    # ---------------- model ----------------
    cfg = Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        hidden_act="silu", max_position_embeddings=1024, initializer_range=0.02, rms_norm_eps=1e-6,
        use_cache=True, tie_word_embeddings=True, rope_theta=10000.0, attention_bias=False,
        attention_dropout=0.0, decoder_sparse_step=1, moe_intermediate_size=a.moe_inter,
        num_experts_per_tok=a.topk, num_experts=a.experts, norm_topk_prob=True,
        output_router_logits=True, router_aux_loss_coef=a.aux, mlp_only_layers=[],
        bos_token_id=EOT, eos_token_id=[ids["<|im_end|>"], EOT], pad_token_id=EOT,
    )
    model = Qwen3MoeForCausalLM(cfg).to(dev)
    n_total = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    n_active = n_total - n_expert + n_expert * a.topk // a.experts
    log(f"model: {n_total/1e6:.2f}M params total, {n_active/1e6:.2f}M active per token "
        f"(experts {n_expert/1e6:.2f}M; bf16 size {2*n_total/1e6:.1f} MB); experts impl "
        f"{getattr(model.config, '_experts_implementation', None)}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=(dev == "cuda"))
    amp = torch.autocast(device_type="cuda" if dev == "cuda" else "cpu", dtype=torch.bfloat16,
                         enabled=(dev == "cuda"))

    def layer_balance_loss(router_logits):
        """Switch-style load-balancing loss computed per layer and averaged (1.0 when balanced).
        transformers' own aux_loss pools all layers' router logits together, so it only balances the
        expert index summed over layers and lets individual layers starve experts."""
        losses = []
        for rl in router_logits:
            p = rl.float().softmax(-1)
            top = p.topk(a.topk, dim=-1).indices
            f = torch.zeros(a.experts, device=p.device).scatter_add_(
                0, top.reshape(-1), torch.ones(top.numel(), device=p.device)) / top.numel()
            losses.append(a.experts * (f * p.mean(0)).sum())
        return torch.stack(losses).mean()

    @torch.no_grad()
    def evaluate():
        model.eval()
        tot, n = 0.0, 0
        bs = max(1, a.batch // 2)
        for i in range(0, n_vb, bs):
            x, y = val_x[i:i + bs].to(dev), val_y[i:i + bs].to(dev)
            with amp:
                out = model(input_ids=x, output_router_logits=False)
            l = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, a.vocab), y.reshape(-1),
                                                  reduction="sum")
            tot += l.item()
            n += y.numel()
        model.train()
        return tot / max(n, 1)

    # ---------------- training ----------------
    budget = a.minutes * 60
    t_train = time.time()
    total_steps = None
    step = 0
    hist = []
    best = (float("inf"), 0, None)
    model.train()
    while True:
        el = time.time() - t_train
        if total_steps is None and (step == 30 or el > budget * 0.1):
            # estimate how many steps fit the budget (eval overhead included) and fix the schedule
            per = el / max(step, 1)
            total_steps = max(step + 10, int(budget / per * 0.93))
            log(f"{per*1000:.0f} ms/step -> {total_steps} steps "
                f"({total_steps*a.batch*a.seq/1e6:.0f}M tokens, "
                f"{total_steps*a.batch*a.seq/train_stream.numel():.1f} epochs)")
        if total_steps is not None and step >= total_steps:
            break
        T = total_steps or 10 ** 9
        if step < a.warmup:
            lr = a.lr * (step + 1) / a.warmup
        else:
            pr = min(1.0, (step - a.warmup) / max(1, T - a.warmup))
            lr = a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * pr)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = get_batch()

        def fwd_bwd():
            with amp:
                out = model(input_ids=x, labels=None, output_router_logits=True)
                ce = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, a.vocab), y.reshape(-1))
                bal = layer_balance_loss(out.router_logits)
                loss = ce + a.aux * bal
            opt.zero_grad(set_to_none=True)
            loss.backward()
            out.bal = bal
            return out, ce

        if step == 0:
            # the fused grouped_mm experts path differs between transformers versions: fall back if it fails
            for impl in [None, "batched_mm", "eager"]:
                try:
                    if impl:
                        model.set_experts_implementation(impl)
                    out, ce = fwd_bwd()
                    break
                except Exception as e:  # noqa: BLE001
                    log(f"experts implementation {impl or 'default'} failed ({type(e).__name__}: {str(e)[:300]})")
            log(f"experts implementation in use: {getattr(model.config, '_experts_implementation', None)}")
        else:
            out, ce = fwd_bwd()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or step == 1:
            rec = {"step": step, "time_s": round(time.time() - t_train, 1), "lr": lr,
                   "train_ce": round(ce.item(), 4), "aux_hf": round(out.aux_loss.item(), 4), "balance": round(out.bal.item(), 4),
                   "grad_norm": round(gn.item(), 3)}
            if step % 250 == 0:
                rec["val_ce"] = round(evaluate(), 4)
                if rec["val_ce"] < best[0]:
                    best = (rec["val_ce"], step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            hist.append(rec)
            log(json.dumps(rec))
    train_time = time.time() - t_train
    final_val = evaluate()
    if best[2] is not None and best[0] < final_val:
        log(f"final val ce {final_val:.4f} worse than step {best[1]}'s {best[0]:.4f}: restoring that checkpoint")
        model.load_state_dict(best[2])
        final_val = evaluate()
    best = None
    log(f"trained {step} steps ({step*a.batch*a.seq/1e6:.1f}M tokens) in {train_time:.0f}s; "
        f"final val ce {final_val:.4f} (ppl {math.exp(final_val):.2f})")

    # ---------------- export ----------------
    model.eval()
    model.config.output_router_logits = False  # inference default
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=0.8, top_p=0.95, top_k=40, repetition_penalty=1.1, max_new_tokens=256,
        eos_token_id=[ids["<|im_end|>"], EOT], pad_token_id=EOT, bos_token_id=EOT)
    model.to(torch.bfloat16).save_pretrained(a.out, max_shard_size="15MB")
    # also write the transformers-4 spellings (num_experts, rope_theta) so that older readers agree
    cp = os.path.join(a.out, "config.json")
    c = json.load(open(cp))
    c["num_experts"] = c.get("num_local_experts", a.experts)
    c["rope_theta"] = c.get("rope_parameters", {}).get("rope_theta", 10000.0)
    json.dump(dict(sorted(c.items())), open(cp, "w"), indent=2)
    log("exported: " + ", ".join(f"{f} {os.path.getsize(os.path.join(a.out, f))}" for f in sorted(os.listdir(a.out))))

    # ---------------- evaluation of the exported (bf16) weights, computed in f32 ----------------
    m = Qwen3MoeForCausalLM.from_pretrained(a.out, dtype=torch.float32).to(dev).eval()
    enc = hf_tok(heldout_text, add_special_tokens=False)["input_ids"]
    ids_t = torch.tensor(enc, device=dev)
    L = 512
    nll, cnt = 0.0, 0
    counts = torch.zeros(a.layers, a.experts, dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, len(enc) - 1, L):
            chunk = ids_t[i:i + L + 1]
            if chunk.numel() < 2:
                break
            o = m(input_ids=chunk[None, :-1], output_router_logits=True)
            nll += torch.nn.functional.cross_entropy(o.logits[0].float(), chunk[1:], reduction="sum").item()
            cnt += chunk.numel() - 1
            for li, rl in enumerate(o.router_logits):
                top = rl.float().topk(a.topk, dim=-1).indices.reshape(-1).cpu()
                counts[li] += torch.bincount(top, minlength=a.experts).double()
    ppl = math.exp(nll / cnt)
    frac = (counts / counts.sum(1, keepdim=True)).tolist()
    load = {"description": "fraction of top-k router assignments per expert, per layer, over the held-out "
                           "text heldout.txt (computed with transformers on the exported weights in f32)",
            "tokens": cnt, "top_k": a.topk, "num_experts": a.experts,
            "layers": [[round(v, 4) for v in row] for row in frac],
            "min_fraction": round(min(min(r) for r in frac), 4),
            "max_fraction": round(max(max(r) for r in frac), 4)}
    with open(os.path.join(a.out, "expert_load.json"), "w") as f:
        json.dump(load, f, indent=1)
    log(f"held-out perplexity (transformers, f32, {cnt} tokens, windows of {L}): {ppl:.3f}")
    for li, row in enumerate(frac):
        log(f"layer {li} load: " + " ".join(f"{v*100:4.1f}" for v in row))

    # ---------------- samples ----------------
    hf_tok = PreTrainedTokenizerFast.from_pretrained(a.out)
    lines = []
    greedy = {}
    for kind, p in SAMPLE_PROMPTS:
        text = p if kind == "plain" else hf_tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        x = torch.tensor([hf_tok(text, add_special_tokens=False)["input_ids"]], device=dev)
        with torch.no_grad():
            g = m.generate(x, do_sample=False, repetition_penalty=1.0, max_new_tokens=48, eos_token_id=[2, 0], pad_token_id=0)
            torch.manual_seed(1234)
            s = m.generate(x, do_sample=True, temperature=0.8, top_p=0.95, top_k=40, repetition_penalty=1.0,
                           max_new_tokens=200,
                           eos_token_id=[2, 0], pad_token_id=0)
        greedy[p] = {"prompt_ids": x[0].tolist(), "greedy_ids": g[0, x.shape[1]:].tolist()}
        lines.append(f"=== [{kind}] {p}\n--- sampled (T=0.8, top_p=0.95, top_k=40):\n"
                     f"{hf_tok.decode(s[0, x.shape[1]:], skip_special_tokens=True).strip()}\n"
                     f"--- greedy (48 tokens):\n{hf_tok.decode(g[0, x.shape[1]:], skip_special_tokens=True).strip()}\n")
    with open(os.path.join(a.out, "samples.txt"), "w") as f:
        f.write("\n".join(lines))
    log("\n".join(lines))
    report = {"train_docs": len(train_items), "val_docs": len(val_items),
              "train_tokens": int(train_stream.numel()), "val_tokens": int(val_stream.numel()),
              "params_total": n_total, "params_active": n_active, "steps": step,
              "batch": a.batch, "seq": a.seq, "tokens_seen": step * a.batch * a.seq,
              "train_time_s": round(train_time, 1), "final_val_ce": round(final_val, 4),
              "heldout_ppl": round(ppl, 3), "heldout_tokens": cnt, "history": hist, "greedy": greedy,
              "args": vars(a), "total_time_s": round(time.time() - t_start, 1)}
    with open(os.path.join(a.out, "train_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    log(f"total {time.time()-t_start:.0f}s")


if __name__ == "__main__":
    main()
