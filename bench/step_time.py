"""Step time of tiny SMELT vs its matched Baseline, eager and compiled, against their FLOPs ratio.

    python bench/step_time.py                     # eager and train.compile=layers (inductor)
    python bench/step_time.py --modes eager --repeats 30 --threads 1

Every candidate (Baseline and SMELT, each eager and with ``train.compile: layers``) takes a
forward + backward + AdamW step on the same random batch; the candidates are timed alternately in
one run, round r in a rotated order (these machines are noisy, so only ratios of medians mean
anything). The first steps (warm-up; compilation happens there and is reported separately) are not
timed. Printed per mode: median step time of each model, the step-time ratio SMELT / Baseline,
the budget's training-FLOPs ratio, and (time ratio) / (FLOPs ratio) -- target 1.00 +- 0.03: looping
costs nothing beyond its FLOPs; and per model compiled / eager -- target <= 0.83.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import torch

from smelt_ds.config.loading import load_config
from smelt_ds.cost.budget import compute_budget
from smelt_ds.model import SmeltLM
from smelt_ds.parallel.compile import compile_counters, compile_layers
from smelt_ds.train.objective import total_loss

ROOT = Path(__file__).resolve().parents[1]
MODES = ("eager", "layers")


def _setup(recipe: str, overrides: list[str], modes: list[str], backend: str):
    """``{mode: (cfg, model, optimizer)}`` for one recipe, the same initial weights in every mode."""
    cfg = load_config(ROOT / recipe, overrides)
    torch.manual_seed(0)
    base = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    out = {}
    for mode in modes:
        model = copy.deepcopy(base)
        if mode != "eager":
            ccfg = load_config(ROOT / recipe, overrides + [f"train.compile={mode}", f"train.compile_backend={backend}"])
            compile_layers(model, ccfg)
        out[mode] = (cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return out


def _step(model, opt, x, y, train_cfg) -> float:
    t0 = time.perf_counter()
    loss = total_loss(model(x, labels=y), train_cfg)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20, help="timed rounds (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (compilation happens here)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--baseline", default="recipes/tiny/baseline.yaml")
    p.add_argument("--smelt", default="recipes/tiny/smelt.yaml")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="eager, and/or layers (train.compile: layers)")
    p.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager", "eager"),
                   help="train.compile_backend for the compiled mode")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ov = [f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}"]
    runs = {(arch, mode): r for arch, path in (("baseline", args.baseline), ("smelt", args.smelt))
            for mode, r in _setup(path, ov, args.modes, args.backend).items()}
    V = runs[("baseline", args.modes[0])][0].model.vocab_size
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, V, (args.micro_batch, args.seq_len + 1), generator=g)
    x, y = w[:, :-1], w[:, 1:]
    names = list(runs)
    times: dict[tuple[str, str], list[float]] = {n: [] for n in names}
    first: dict[tuple[str, str], float] = {}
    for i in range(args.warmup + args.repeats):
        order = names[i % len(names):] + names[:i % len(names)]
        for n in order:
            cfg, model, opt = runs[n]
            dt = _step(model, opt, x, y, cfg.train)
            if i == 0:
                first[n] = dt
            if i >= args.warmup:
                times[n].append(dt)
    med = {n: statistics.median(v) for n, v in times.items()}
    flops = {arch: compute_budget(runs[(arch, args.modes[0])][0], args.seq_len).train_flops_per_token
             for arch in ("baseline", "smelt")}
    f_ratio = flops["smelt"] / flops["baseline"]
    print(f"tiny recipes, CPU fp32, torch {torch.__version__}, {torch.get_num_threads()} threads on "
          f"{os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f}), tokens/step "
          f"{args.micro_batch * args.seq_len}, median of {args.repeats} interleaved rounds after {args.warmup} "
          f"warm-up; compiled = train.compile: layers, backend {args.backend}; compile counters "
          f"{compile_counters()}\n")
    print(f"{'model':9s} {'mode':7s} {'first step s':>12s} {'median ms':>10s}  train FLOPs/token")
    for (arch, mode) in names:
        print(f"{arch:9s} {mode:7s} {first[(arch, mode)]:12.2f} {med[(arch, mode)] * 1e3:10.2f}  "
              f"{flops[arch]:,.0f}")
    print(f"\nFLOPs ratio smelt/baseline: {f_ratio:.4f}")
    for mode in args.modes:
        t_ratio = med[("smelt", mode)] / med[("baseline", mode)]
        r = t_ratio / f_ratio
        print(f"{mode:7s} step-time ratio smelt/baseline {t_ratio:.4f}; (time ratio)/(FLOPs ratio) "
              f"{r:.4f}   target 1.00 +- 0.03: {'met' if abs(r - 1) <= 0.03 else 'missed'}")
    if "eager" in args.modes and "layers" in args.modes:
        for arch in ("baseline", "smelt"):
            r = med[(arch, "layers")] / med[(arch, "eager")]
            print(f"{arch:9s} compiled/eager step time {r:.3f}   target <= 0.83: {'met' if r <= 0.83 else 'missed'}")


if __name__ == "__main__":
    main()
