"""Bytes and seconds of one checkpoint save with and without the reference-layout shards, side by side.

    python bench/checkpoint_cost.py                                   # tiny SMELT on the three backends
    python bench/checkpoint_cost.py --recipe recipes/tiny/baseline.yaml --repeats 5
    python bench/checkpoint_cost.py --backends reference --repeats 1 --json out.json  # the smoke test's setting

The cells: ``reference`` on 1 rank at the recipe's ZeRO stage; ``deepspeed`` at expert-parallel
size 2 and ZeRO-2, and ``autoep`` at expert-parallel size 2 and ZeRO-3 (the large recipes'
layout), each on 2 gloo ranks. Each cell builds the engine training builds
(:func:`smelt_ds.train.build.build`), takes one optimizer step on a fixed random batch (so Adam's
moments exist, as in every checkpoint of a run) and then saves ``--repeats`` times with the
shards and as often without, alternating which goes first (:func:`smelt_ds.runs.checkpoint.save`
with ``reference`` forced on or off: digests while writing, fsync, the ``COMPLETE`` marker,
pruning to one kept checkpoint per kind). The shards here are the weights alone, what export
reads; the layout-free state (the same shards with AdamW's moments, ``train.layout_free_state``)
is measured by bench/reshard_cost.py.

Printed per cell: the reference-layout parameters ``P``; DeepSpeed's own bytes per save (model,
optimizer, per-expert files; the client state of the data loader and RNG is listed apart) and
per parameter; the shards' bytes and per parameter (4 plus the archive's per-tensor records);
bytes of a whole save with / without the shards; median wall-clock seconds of a save without and
with them on rank 0 (a save is collective: it ends with a barrier) and their ratio. ``--json
PATH`` writes the same numbers. docs/checkpoint_cost.md turns the per-parameter bytes into the
XL recipe's cost per save and per run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smelt_ds.config.loading import load_config  # noqa: E402

#: (backend, ZeRO stage or None for the recipe's, expert-parallel size, ranks)
CELLS = {"reference": ("reference", None, 1, 1), "deepspeed": ("deepspeed", 2, 2, 2), "autoep": ("autoep", 3, 2, 2)}


def cell_overrides(backend: str, overrides: list[str]) -> list[str]:
    """The ``--set`` list of ``backend``'s cell: the user's, then the cell's backend, ZeRO stage
    and expert-parallel size (:data:`CELLS`)."""
    _, zero, ep, _ = CELLS[backend]
    out = [*overrides, f"moe_runtime.backend={backend}"]
    if backend != "reference":
        out += [f"moe_runtime.ep_size={ep}", f"deepspeed.zero_stage={zero}"]
    return out


def reference_params(cfg) -> int:
    """Parameters of the reference-layout model (:class:`smelt_ds.model.SmeltLM`, built on the
    meta device), tied tensors once: what the shards hold at 4 bytes each (plus buffers)."""
    from smelt_ds.model import SmeltLM

    with torch.device("meta"):
        model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    return sum(p.numel() for p in model.parameters())


def _one_step(built, cfg, rank: int) -> None:
    from smelt_ds.train.objective import total_loss

    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1), generator=g)
    out = built.engine(ids[:, :-1], labels=ids[:, 1:])
    built.engine.backward(total_loss(out, cfg.train))
    built.engine.step()


def _bytes(ckpt_dir: Path) -> dict[str, int]:
    """Bytes of a saved checkpoint by kind, from its marker's file list."""
    from smelt_ds.runs import checkpoint as ckpt

    files = json.loads((ckpt_dir / ckpt.MARKER).read_text())["files"]
    kinds = {"shards": 0, "client": 0, "deepspeed": 0}
    for name, d in files.items():
        kind = ("shards" if name.startswith("reference/") else "client" if name.startswith("client_rank")
                else "deepspeed")
        kinds[kind] += d["bytes"]
    return kinds


def measure(rank: int, world: int, opts: dict[str, Any], backend: str) -> dict[str, Any] | None:
    """Saves of ``backend``'s cell with and without the shards, interleaved; rank 0 returns the
    numbers (see the module doc), the other ranks None. Collective."""
    import torch.distributed as dist

    from smelt_ds.runs import checkpoint as ckpt
    from smelt_ds.train.build import build

    cfg = load_config(ROOT / opts["recipe"], cell_overrides(backend, opts["overrides"]))
    built = build(cfg, world)
    _one_step(built, cfg, rank)
    work = Path(opts["workdir"]) / backend
    seconds: dict[bool, list[float]] = {True: [], False: []}
    sizes: dict[bool, dict[str, int]] = {}
    for r in range(opts["repeats"]):
        for shards in ((True, False) if r % 2 == 0 else (False, True)):
            dist.barrier()
            t0 = time.perf_counter()
            path = ckpt.save(built.engine, work / ("with" if shards else "without"), r + 1, 0, {}, keep_last=1,
                             layout=built.layout, reference=shards, optimizer_state=False)
            seconds[shards].append(time.perf_counter() - t0)
            if rank == 0:
                sizes[shards] = _bytes(path)
    if rank != 0:
        return None
    with_s, without_s = statistics.median(seconds[True]), statistics.median(seconds[False])
    return {"backend": backend, "zero_stage": cfg.deepspeed.zero_stage, "ep_size": CELLS[backend][2],
            "ranks": world, "params": reference_params(cfg), "deepspeed_bytes": sizes[False]["deepspeed"],
            "client_bytes": sizes[False]["client"], "shard_bytes": sizes[True]["shards"],
            "bytes_with": sum(sizes[True].values()), "bytes_without": sum(sizes[False].values()),
            "seconds_with": with_s, "seconds_without": without_s, "seconds_ratio": with_s / without_s}


def _cells_on(rank: int, world: int, opts: dict[str, Any], backends: list[str]) -> list[dict[str, Any] | None]:
    return [measure(rank, world, opts, b) for b in backends]


def _in_process(opts: dict[str, Any], backends: list[str]) -> list[dict[str, Any]]:
    from smelt_ds.parallel.distributed import init_distributed

    init_distributed()
    return [r for r in _cells_on(0, 1, opts, backends) if r is not None]


def format_table(rows: list[dict[str, Any]], recipe: str, repeats: int) -> str:
    """The printed table: one line per cell."""
    lines = [f"Checkpoint cost of one save, {recipe}: medians of {repeats} saves with and {repeats} without the "
             "reference-layout shards, interleaved; B = bytes, P = reference-layout parameters",
             f"{'backend':10s} {'ZeRO':>4s} {'EP':>2s} {'ranks':>5s} {'P':>10s} {'DeepSpeed B':>12s} {'B/P':>5s} "
             f"{'shard B':>10s} {'B/P':>5s} {'B with/without':>14s} {'s without':>9s} {'s with':>7s} "
             f"{'s with/without':>14s}"]
    for r in rows:
        lines.append(f"{r['backend']:10s} {r['zero_stage']:4d} {r['ep_size']:2d} {r['ranks']:5d} {r['params']:10d} "
                     f"{r['deepspeed_bytes']:12d} {r['deepspeed_bytes'] / r['params']:5.2f} {r['shard_bytes']:10d} "
                     f"{r['shard_bytes'] / r['params']:5.2f} {r['bytes_with'] / r['bytes_without']:14.3f} "
                     f"{r['seconds_without']:9.3f} {r['seconds_with']:7.3f} {r['seconds_ratio']:14.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/tiny/smelt.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override for every cell (before the cell's backend, ZeRO stage and EP size)")
    p.add_argument("--backends", nargs="+", choices=list(CELLS), default=list(CELLS))
    p.add_argument("--repeats", type=int, default=3, help="saves of each kind per cell (median reported)")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    with tempfile.TemporaryDirectory(prefix="checkpoint-cost-") as work:
        opts = {"recipe": args.recipe, "overrides": args.overrides, "repeats": args.repeats, "workdir": work}
        one = [b for b in args.backends if CELLS[b][3] == 1]
        two = [b for b in args.backends if CELLS[b][3] == 2]
        rows = _in_process(opts, one) if one else []
        if two:
            from smelt_ds.testing import run_distributed

            rows += [r for r in run_distributed(_cells_on, world_size=2, args=(opts, two), timeout=600.0)[0] if r]
    print(format_table(rows, args.recipe, args.repeats))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
