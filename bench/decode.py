"""Decode latency of tiny SMELT vs its matched Baseline (random weights, per-visit KV cache).

    python bench/decode.py [--repeats 10] [--prompt-len 32] [--new-tokens 64] [--batch 1]

Both models (recipes/tiny/baseline.yaml and recipes/tiny/smelt.yaml: same visits, so the same
forward FLOPs per token and KV cache within 1%) decode the same random prompt greedily with
``SmeltLM.generate`` (prefill, then one token per step through the per-visit KV cache), timed
alternately in one run (these machines are noisy, so only the ratio of medians means anything).
Printed: median seconds per new token of each (prefill included, divided by new tokens), tokens/s,
the latency ratio smelt/baseline, the forward-FLOPs ratio and the KV-cache ratio from the budget.
Equal FLOPs should mean a ratio near 1; on CPU at batch 1 the per-visit overhead (kernel
launches, the looping manager, routing to more experts) is not proportional to FLOPs, so expect
some deviation.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from smelt_ds.config.loading import load_config
from smelt_ds.cost.budget import compute_budget
from smelt_ds.model import SmeltLM

ROOT = Path(__file__).resolve().parents[1]


def _decode(model, prompt, new_tokens: int) -> float:
    t0 = time.perf_counter()
    out = model.generate(prompt, new_tokens)
    dt = time.perf_counter() - t0
    assert out.shape[1] == prompt.shape[1] + new_tokens
    return dt / new_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per measurement")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on shared CPUs)")
    p.add_argument("--baseline", default="recipes/tiny/baseline.yaml")
    p.add_argument("--smelt", default="recipes/tiny/smelt.yaml")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfgs = {"baseline": load_config(ROOT / args.baseline), "smelt": load_config(ROOT / args.smelt)}
    models = {}
    for name, cfg in cfgs.items():
        torch.manual_seed(0)
        models[name] = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval()
    V = cfgs["baseline"].model.vocab_size
    prompt = torch.randint(0, V, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    times = {name: [] for name in models}
    with torch.no_grad():
        for i in range(args.warmup + args.repeats):
            order = list(models) if i % 2 == 0 else list(reversed(models))
            for name in order:
                dt = _decode(models[name], prompt, args.new_tokens)
                if i >= args.warmup:
                    times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    seq = args.prompt_len + args.new_tokens
    budgets = {k: compute_budget(cfgs[k], seq) for k in cfgs}
    print(f"threads {torch.get_num_threads()}, batch {args.batch}, prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, {args.repeats} repeats (alternating)")
    for k in models:
        b = budgets[k]
        print(f"{k:9s} {med[k] * 1e3:7.2f} ms/token  {args.batch / med[k]:8.1f} tokens/s  "
              f"{b.visits} visits of {b.unique_layers} unique layers, {cfgs[k].moe.num_experts} experts")
    ratio = med["smelt"] / med["baseline"]
    f_ratio = budgets["smelt"].forward_flops_per_token / budgets["baseline"].forward_flops_per_token
    kv_ratio = budgets["smelt"].kv_cache_bytes_per_token / budgets["baseline"].kv_cache_bytes_per_token
    print(f"decode-latency ratio smelt/baseline: {ratio:.3f}")
    print(f"forward-FLOPs ratio smelt/baseline:  {f_ratio:.3f}   KV-cache ratio: {kv_ratio:.3f}")
    print(f"(latency ratio)/(FLOPs ratio):       {ratio / f_ratio:.3f}   equal FLOPs: expect near 1")


if __name__ == "__main__":
    main()
