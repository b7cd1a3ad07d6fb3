"""What the profiler's named ranges cost, on the tiny SMELT recipe, side by side in one run.

The model's ranges (``layer L visit V`` per visit, ``moe route|dispatch|experts|combine`` per MoE
stage; :mod:`smelt_ds.model.ranges`) are off unless a profiler records. Three settings of the same
model, weights and batch run one training step (forward + backward of the training objective)
each per round, in a rotated order; tokens/s is the median over rounds:

- ``off``: as training runs without profiling (each range is one flag check);
- ``ranges on``: the ranges entered (``torch.profiler.record_function``) with no profiler recording;
- ``profiling``: a ``torch.profiler.profile`` recording, ranges on (what a profiled step costs).

The difference between ``off`` and code without ranges is the flag checks alone, too small to
see in step times: it is measured directly (the off path of :func:`smelt_ds.model.ranges.named_range`
timed over many calls) and reported per step (calls per step = visits + 4 per MoE visit, per
micro-batch) and as a share of the ``off`` step time.

    python bench/profile_overhead.py                       # recipes/tiny/smelt.yaml, 10 rounds
    python bench/profile_overhead.py --rounds 20 --threads 1
    python bench/profile_overhead.py --set train.micro_batch_size=2
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

from smelt_ds.config.loading import load_config
from smelt_ds.model import SmeltLM
from smelt_ds.model.ranges import named_range, set_ranges
from smelt_ds.train.objective import total_loss

MODES = ("off", "ranges on", "profiling")


def step_seconds(model, ids, labels, train_cfg, mode: str) -> float:
    """Seconds of one forward + backward in ``mode`` (one of :data:`MODES`)."""
    model.zero_grad(set_to_none=True)
    set_ranges(mode != "off")
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if mode == "profiling" else None
    try:
        if prof is not None:
            prof.start()
        t = time.perf_counter()
        total_loss(model(ids, labels=labels), train_cfg).backward()
        seconds = time.perf_counter() - t
        if prof is not None:
            prof.stop()
    finally:
        set_ranges(False)
    return seconds


def off_check_seconds(calls: int = 200_000) -> float:
    """Seconds of one ``with named_range("layer {} visit {}", 1, 0): pass`` with the ranges off."""
    set_ranges(False)

    def one() -> None:
        with named_range("layer {} visit {}", 1, 0):
            pass

    return min(timeit.repeat(one, number=calls, repeat=3)) / calls


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/tiny/smelt.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (each runs every mode once)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.recipe, args.set)
    torch.manual_seed(0)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop).train()
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    window = torch.randint(0, cfg.model.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(0))
    ids, labels = window[:, :-1], window[:, 1:]
    for mode in MODES:  # warm-up: allocator, kernels, the profiler's first start
        step_seconds(model, ids, labels, cfg.train, mode)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
            times[mode].append(step_seconds(model, ids, labels, cfg.train, mode))
    median = {m: statistics.median(t) for m, t in times.items()}
    print(f"{cfg.name}: {B} x {S} tokens per step, {len(cfg.schedule.plan)} visits, median of {args.rounds} rounds")
    print(f"{'mode':<12} {'tokens/s':>10} {'x off':>7}")
    for m in MODES:
        print(f"{m:<12} {B * S / median[m]:>10,.0f} {median['off'] / median[m]:>7.3f}")
    moe_visits = sum(v.layer >= cfg.model.first_k_dense for v in cfg.schedule.plan)
    calls = len(cfg.schedule.plan) + 4 * moe_visits
    check = off_check_seconds()
    print(f"off vs no ranges: {calls} flag checks per forward x {check * 1e9:.0f} ns = {calls * check * 1e6:.1f} us "
          f"per micro-batch, {calls * check / median['off']:.2e} of the off step time")


if __name__ == "__main__":
    main()
