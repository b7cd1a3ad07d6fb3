"""Training-step time of one recipe under the three MoE backends (reference, deepspeed, autoep), side by side.

    python bench/backend_step.py                                   # tiny SMELT, 1 rank, 1 thread
    python bench/backend_step.py --ranks 2                         # 2 gloo ranks, ep_size 2 for deepspeed/autoep
    python bench/backend_step.py --set moe_runtime.capacity_factor=2.0  # capacity keys: deepspeed only
    python bench/backend_step.py --busy 1 --threads 2              # another torch process beside
    python bench/backend_step.py --repeats 1 --warmup 0 --json out.json  # the smoke test's setting

Each backend gets the engine training builds (:func:`smelt_ds.train.build.build`: same seed, so
the same initial weights) and runs the training step of :mod:`smelt_ds.train.loop` (forward,
objective, ``engine.backward``, gradient norm and clipping, ``engine.step``) on one fixed random
batch. The backends take turns, round r in a rotated order, after ``--warmup`` untimed rounds
(shared machines are noisy, so only the medians of interleaved rounds mean anything).
``--set`` overrides apply to every backend, except the capacity keys of ``moe_runtime``
(``capacity_factor``, ``eval_capacity_factor``, ``min_capacity``, ``drop_tokens``, ``use_tutel``),
which only the ``deepspeed`` backend has.

Printed per backend: median wall-clock ms per step and tokens/s (all ranks' tokens), the ratio
reference / backend (1.00 = as fast), the parts of the step (forward, backward with DeepSpeed's
gradient reduction, gradient norm and clipping, optimizer step) in ms of the main thread's CPU
time with 1 thread (what the step computes, without the time other processes held the core) or
of wall time with several, the parameter tensors, aten operations per step (counted once,
untimed: each one is a kernel launch and, with several threads, an OpenMP fork/join), the first
step's loss and the share of routed token copies the capacity limit dropped in the last step
(mean over MoE visits; deepspeed only). ``--json PATH`` writes the same numbers. With ``--ranks
2`` rank 0's parts are reported; its wall time includes waiting for the other rank.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smelt_ds.config.loading import load_config  # noqa: E402

BACKENDS = ("reference", "deepspeed", "autoep")
PARTS = ("forward", "backward", "clip", "optimizer")
#: what a ``--busy`` process runs: small GEMMs on as many torch threads as a rank has (another
#: training sharing the cores: its OpenMP threads compete with ours at every parallel region)
BUSY_LOOP = ("import torch; torch.set_num_threads({threads}); a = torch.randn(256, 256)\n"
             "while True: torch.mm(a, a).add_(1.0)")
#: ``moe_runtime`` keys only the deepspeed backend accepts (the others are dropless)
DEEPSPEED_ONLY = ("capacity_factor", "eval_capacity_factor", "min_capacity", "drop_tokens", "use_tutel")


def backend_overrides(backend: str, overrides: list[str], ranks: int, ep_size: int | None) -> list[str]:
    """The ``--set`` list for ``backend``: the user's, without the deepspeed-only capacity keys for
    the other backends, plus ``moe_runtime.backend`` and (expert-parallel backends) ``ep_size``
    (default: ``ranks``)."""
    keep = [o for o in overrides if backend == "deepspeed"
            or o.split("=", 1)[0] not in {f"moe_runtime.{k}" for k in DEEPSPEED_ONLY}]
    out = keep + [f"moe_runtime.backend={backend}"]
    if backend != "reference":
        out.append(f"moe_runtime.ep_size={ep_size or ranks}")
    return out


def _count_ops(fn) -> int:
    """aten operations ``fn()`` dispatches (views and in-place updates included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with _Count() as mode:
        fn()
    return sum(mode.ops.values())


class _Candidate:
    """One backend's engine and the training step's parts, timed."""

    def __init__(self, backend: str, cfg, world: int):
        from smelt_ds.train.build import build

        self.backend, self.cfg = backend, cfg
        self.built = build(cfg, world)
        self.engine = self.built.engine
        self.wall: list[float] = []
        self.parts: dict[str, list[float]] = {p: [] for p in PARTS}
        self.first_loss: float | None = None

    def step(self, ids: torch.Tensor, clock, record: bool) -> None:
        from smelt_ds.parallel.grad_norm import clip_before_step
        from smelt_ds.train.objective import total_loss

        w0 = time.perf_counter()
        t = [clock()]
        out = self.engine(ids[:, :-1], labels=ids[:, 1:])
        t.append(clock())
        loss = total_loss(out, self.cfg.train)
        self.engine.backward(loss)
        t.append(clock())
        clip_before_step(self.engine, self.cfg.train.grad_clip)
        t.append(clock())
        self.engine.step()
        t.append(clock())
        wall = time.perf_counter() - w0
        if self.first_loss is None:
            self.first_loss = float(loss.detach())
        if record:
            self.wall.append(wall)
            for name, (a, b) in zip(PARTS, itertools.pairwise(t), strict=True):
                self.parts[name].append(b - a)

    def dropped_share(self) -> float | None:
        """Mean over MoE visits of the last step's dropped share (deepspeed backend), else None."""
        routes = getattr(self.built.model.recorder, "routes", {})
        shares = [r.dropped_share for r in routes.values() if hasattr(r, "dropped_share")]
        return statistics.mean(shares) if shares else None


def _batch(cfg, rank: int) -> torch.Tensor:
    """This rank's fixed ``(micro_batch, seq_len + 1)`` token ids (the same in every backend)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1), generator=g)


def run(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any] | None:
    """Build every backend of ``opts["backends"]``, time the interleaved rounds; rank 0 returns
    ``{backend: numbers}`` (see the module doc), the other ranks None. Collective."""
    import torch.distributed as dist

    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    cands = []
    for b in opts["backends"]:
        cfg = load_config(ROOT / opts["recipe"], backend_overrides(b, opts["overrides"], world, opts["ep_size"]))
        cands.append(_Candidate(b, cfg, world))
    ids = _batch(cands[0].cfg, rank)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    ops = {c.backend: _count_ops(lambda c=c: c.step(ids, clock, record=False)) for c in cands}
    for _ in range(opts["warmup"]):
        for c in cands:
            c.step(ids, clock, record=False)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(threads=torch.get_num_threads())])
            for _ in range(opts["busy"] if rank == 0 else 0)]
    try:
        for r in range(opts["repeats"]):
            for c in cands[r % len(cands):] + cands[:r % len(cands)]:
                dist.barrier()
                c.step(ids, clock, record=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    if rank != 0:
        return None
    tokens = cands[0].cfg.train.micro_batch_size * cands[0].cfg.train.seq_len * world
    out = {}
    for c in cands:
        n_params = sum(1 for _ in c.built.model.parameters())
        out[c.backend] = {"step_ms": statistics.median(c.wall) * 1e3, "tokens_per_step": tokens,
                          "tokens_per_s": tokens / statistics.median(c.wall),
                          "parts_cpu_ms": {p: statistics.median(v) * 1e3 for p, v in c.parts.items()},
                          "param_tensors": n_params, "aten_ops_per_step": ops[c.backend],
                          "first_loss": c.first_loss, "dropped_share": c.dropped_share()}
    return out


def _in_process(opts: dict[str, Any]) -> dict[str, Any]:
    from smelt_ds.parallel.distributed import init_distributed

    init_distributed()
    result = run(0, 1, opts)
    assert result is not None
    return result


def format_table(res: dict[str, Any], ranks: int, threads: int, busy: int) -> str:
    """The printed table: one line per backend, ratio against ``reference`` when it ran."""
    first = next(iter(res.values()))
    lines = [f"MoE backends, {first['tokens_per_step']} tokens per step ({ranks} rank(s), {threads} thread(s) "
             f"per rank{f', {busy} busy process(es) beside' if busy else ''}); "
             "parts in ms of " + ("main-thread CPU time" if threads == 1 else "wall time (several threads)"),
             f"{'backend':10s} {'step ms':>8s} {'tokens/s':>9s} {'ref/this':>8s} "
             + " ".join(f"{p:>9s}" for p in PARTS) + f" {'params':>6s} {'ops/step':>8s} {'loss0':>7s} {'dropped':>7s}"]
    ref = res.get("reference")
    for b, r in res.items():
        ratio = f"{ref['step_ms'] / r['step_ms']:8.2f}" if ref else f"{'-':>8s}"
        drop = "-" if r["dropped_share"] is None else f"{r['dropped_share']:.3f}"
        lines.append(f"{b:10s} {r['step_ms']:8.1f} {r['tokens_per_s']:9.0f} {ratio} "
                     + " ".join(f"{r['parts_cpu_ms'][p]:9.1f}" for p in PARTS)
                     + f" {r['param_tensors']:6d} {r['aten_ops_per_step']:8d} {r['first_loss']:7.4f} {drop:>7s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/tiny/smelt.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override for every backend (capacity keys: deepspeed only)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--ranks", type=int, choices=(1, 2), default=1, help="gloo ranks on this machine")
    p.add_argument("--ep-size", type=int, default=None,
                   help="expert-parallel size of deepspeed/autoep (default: --ranks)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (0: torch's default)")
    p.add_argument("--repeats", type=int, default=10, help="timed rounds (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--busy", type=int, default=0,
                   help="torch processes running small GEMMs beside the timed rounds (a shared machine)")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.busy < 0:
        p.error("--repeats must be >= 1, --warmup and --busy >= 0")
    opts = {k: getattr(args, k) for k in ("recipe", "overrides", "backends", "ep_size", "threads", "repeats",
                                           "warmup", "busy")}
    if args.ranks == 1:
        res = _in_process(opts)
    else:
        from smelt_ds.testing import run_distributed

        res = run_distributed(run, world_size=args.ranks, args=(opts,), num_threads=args.threads,
                              timeout=600.0)[0]
    threads = args.threads or torch.get_num_threads()
    print(format_table(res, args.ranks, threads, args.busy))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
