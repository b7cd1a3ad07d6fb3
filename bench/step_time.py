"""Step time of tiny SMELT vs its matched Baseline, divided by their FLOPs ratio.

    python bench/step_time.py [--repeats 20] [--seq-len 128] [--micro-batch 8]

Both models take a forward + backward + AdamW step on the same random batch; the two are timed
alternately in one run (these machines are noisy, so only the ratio of medians means anything).
Printed: median step time of each, their ratio, the budget's training-FLOPs ratio, and
(time ratio) / (FLOPs ratio). Target: within 5% of 1.0 on CPU, i.e. looping costs nothing
beyond its FLOPs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from smelt_ds.cost.budget import compute_budget
from smelt_ds.config.run import load_config
from smelt_ds.model import SmeltLM
from smelt_ds.train.objective import total_loss

ROOT = Path(__file__).resolve().parents[1]


def _setup(recipe: str, overrides: list[str]):
    cfg = load_config(ROOT / recipe, overrides)
    torch.manual_seed(0)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return cfg, model, opt


def _step(model, opt, x, y, train_cfg) -> float:
    t0 = time.perf_counter()
    loss = total_loss(model(x, labels=y), train_cfg)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--baseline", default="recipes/tiny/baseline.yaml")
    p.add_argument("--smelt", default="recipes/tiny/smelt.yaml")
    args = p.parse_args()
    ov = [f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}"]
    runs = {name: _setup(path, ov) for name, path in (("baseline", args.baseline), ("smelt", args.smelt))}
    V = runs["baseline"][0].model.vocab_size
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, V, (args.micro_batch, args.seq_len + 1), generator=g)
    x, y = w[:, :-1], w[:, 1:]
    times = {name: [] for name in runs}
    for i in range(args.warmup + args.repeats):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            cfg, model, opt = runs[name]
            dt = _step(model, opt, x, y, cfg.train)
            if i >= args.warmup:
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    flops = {k: compute_budget(runs[k][0], args.seq_len).train_flops_per_token for k in runs}
    t_ratio, f_ratio = med["smelt"] / med["baseline"], flops["smelt"] / flops["baseline"]
    print(f"threads: {torch.get_num_threads()}, tokens/step: {args.micro_batch * args.seq_len}, "
          f"repeats: {args.repeats}")
    for k in runs:
        print(f"{k:9s} median step {med[k] * 1e3:8.2f} ms  train FLOPs/token {flops[k]:,.0f}")
    print(f"step-time ratio smelt/baseline: {t_ratio:.4f}")
    print(f"FLOPs ratio smelt/baseline:     {f_ratio:.4f}")
    print(f"(time ratio)/(FLOPs ratio):     {t_ratio / f_ratio:.4f}   target: within 0.95..1.05")


if __name__ == "__main__":
    main()
