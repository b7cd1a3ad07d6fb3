"""Training tokens/s in bf16 against fp32 on this machine, side by side in one run.

    python bench/bf16_step.py                                   # tiny Baseline, training's threads
    python bench/bf16_step.py --recipe recipes/tiny/smelt.yaml --threads 1
    python bench/bf16_step.py --row-block 1                     # bf16 expert rows as routed (before row blocks)
    python bench/bf16_step.py --set model.vocab_size=1024 --set model.hidden_size=64 \\
        --set moe.expert_ffn_size=48 --set train.seq_len=256     # a size of recipes/sweeps/ladder.yaml

Each precision gets the engine training builds (:func:`smelt_ds.train.build.build`: the same seed,
``train.precision`` fp32 or bf16, so DeepSpeed's ``bf16`` section and, at ZeRO-0, its optimizer
wrapper with fp32 master weights) and runs the training step of :mod:`smelt_ds.train.loop`
(forward, objective, ``engine.backward``, gradient norm and clipping, ``engine.step``). Every
round draws a fresh random batch, the same for both precisions: the experts' row counts follow the
routing and change at every step, as in training (a fixed batch would hide what that costs). The
precisions take turns, in alternating order, after ``--warmup`` untimed rounds; only medians of
interleaved rounds mean anything on a shared machine.

Printed first, the matmul GFLOP/s of fp32 and bf16 at 2048^3 and at the recipe's own products
(head, Q/K/V, an expert's gate/up at its mean row count), then per precision the median step ms,
tokens/s and the step's parts (forward, backward, clip, optimizer; medians of wall ms), and the
bf16 / fp32 tokens/s ratio. ``--row-block N`` sets
:data:`smelt_ds.model.experts.CPU_BF16_ROW_BLOCK` for the run (1: each expert's rows as routed,
the behaviour before the row blocks). Results: ``docs/results/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smelt_ds.config.loading import load_config  # noqa: E402

PRECISIONS = ("fp32", "bf16")
PARTS = ("forward", "backward", "clip", "optimizer")


def _gflops(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """GFLOP/s of ``(m, k) @ (k, n)`` in ``dtype``, repeated for about ``seconds`` after 3 calls."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        a @ b
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        calls += 1
    return 2 * m * k * n * calls / (time.perf_counter() - t0) / 1e9


def matmul_lines(cfg) -> list[str]:
    """fp32 and bf16 GFLOP/s at 2048^3 and the recipe's head, Q/K/V and expert gate/up products."""
    m, moe, t = cfg.model, cfg.moe, cfg.train
    T = t.micro_batch_size * t.seq_len
    shapes = [("2048 x 2048 x 2048", (2048, 2048, 2048)),
              ("head T x H x V", (T, m.hidden_size, m.vocab_size)),
              ("Q/K/V T x H x 3H", (T, m.hidden_size, 3 * m.hidden_size)),
              ("expert gate/up (T K / E) x H x 2F",
               (max(1, T * moe.top_k // moe.num_experts), m.hidden_size, 2 * moe.expert_ffn_size))]
    lines = [f"matmul GFLOP/s ({torch.get_num_threads()} thread(s)): {'':22s} {'fp32':>7s} {'bf16':>7s} {'ratio':>6s}"]
    for name, (a, b, c) in shapes:
        f32, b16 = _gflops(a, b, c, torch.float32), _gflops(a, b, c, torch.bfloat16)
        lines.append(f"  {name:34s} {f'{a}x{b}x{c}':>16s} {f32:7.1f} {b16:7.1f} {b16 / f32:6.2f}")
    return lines


class _Candidate:
    """One precision's engine and its timed training steps."""

    def __init__(self, precision: str, recipe: str, overrides: list[str]):
        from smelt_ds.train.build import build

        self.precision = precision
        self.cfg = load_config(ROOT / recipe, [*overrides, f"train.precision={precision}"])
        self.engine = build(self.cfg, 1).engine
        self.wall: list[float] = []
        self.parts: dict[str, list[float]] = {p: [] for p in PARTS}

    def step(self, ids: torch.Tensor, record: bool) -> None:
        from smelt_ds.parallel.grad_norm import clip_before_step
        from smelt_ds.train.objective import total_loss

        t = [time.perf_counter()]
        out = self.engine(ids[:, :-1], labels=ids[:, 1:])
        t.append(time.perf_counter())
        self.engine.backward(total_loss(out, self.cfg.train))
        t.append(time.perf_counter())
        clip_before_step(self.engine, self.cfg.train.grad_clip)
        t.append(time.perf_counter())
        self.engine.step()
        t.append(time.perf_counter())
        if record:
            self.wall.append(t[-1] - t[0])
            for i, name in enumerate(PARTS):
                self.parts[name].append(t[i + 1] - t[i])


def run(recipe: str, overrides: list[str], repeats: int, warmup: int) -> dict[str, dict[str, float]]:
    """``{precision: {"step_ms", "tokens_per_s", <part>_ms...}}`` of interleaved rounds."""
    from smelt_ds.parallel.distributed import init_distributed

    init_distributed()
    cands = [_Candidate(p, recipe, overrides) for p in PRECISIONS]
    cfg = cands[0].cfg
    gen = torch.Generator().manual_seed(0)
    for r in range(warmup + repeats):
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1),
                            generator=gen)
        for c in cands if r % 2 else cands[::-1]:
            c.step(ids, record=r >= warmup)
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len
    return {c.precision: {"step_ms": statistics.median(c.wall) * 1e3,
                          "tokens_per_s": tokens / statistics.median(c.wall),
                          **{f"{p}_ms": statistics.median(v) * 1e3 for p, v in c.parts.items()}} for c in cands}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/tiny/baseline.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override for both precisions")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: what training picks, smelt_ds.parallel.threads)")
    p.add_argument("--repeats", type=int, default=20, help="timed rounds (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--row-block", type=int, default=None,
                   help="rows per bf16 expert block on CPU (1: rows as routed; default: the model's)")
    p.add_argument("--no-matmul", action="store_true", help="skip the matmul GFLOP/s lines")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.threads < 0 or (args.row_block is not None and args.row_block < 1):
        p.error("--repeats and --row-block must be >= 1, --warmup and --threads >= 0")
    from smelt_ds.model import experts
    from smelt_ds.parallel.threads import apply_threads, thread_choice

    if args.threads:
        torch.set_num_threads(args.threads)
    else:
        apply_threads(thread_choice())
    if args.row_block is not None:
        experts.CPU_BF16_ROW_BLOCK = args.row_block
    cfg = load_config(ROOT / args.recipe, args.overrides)
    if not args.no_matmul:
        print("\n".join(matmul_lines(cfg)))
    res = run(args.recipe, args.overrides, args.repeats, args.warmup)
    print(f"training steps of {cfg.name}, {cfg.train.micro_batch_size * cfg.train.seq_len} tokens per step, "
          f"{torch.get_num_threads()} thread(s), bf16 expert row block {experts.CPU_BF16_ROW_BLOCK}, "
          f"median of {args.repeats} interleaved rounds (wall ms)")
    print(f"{'precision':9s} {'step ms':>8s} {'tokens/s':>9s} " + " ".join(f"{p:>9s}" for p in PARTS))
    for prec, r in res.items():
        print(f"{prec:9s} {r['step_ms']:8.1f} {r['tokens_per_s']:9.0f} "
              + " ".join(f"{r[f'{p}_ms']:9.1f}" for p in PARTS))
    print(f"bf16 / fp32 tokens/s: {res['bf16']['tokens_per_s'] / res['fp32']['tokens_per_s']:.2f}")
    return res


if __name__ == "__main__":
    main()
