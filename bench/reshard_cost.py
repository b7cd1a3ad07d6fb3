"""Cost of a resume at another layout: the save of the layout-free state and its conversion, by model size.

    python bench/reshard_cost.py                      # tiny SMELT widened 1x, 2x, 4x, 8x
    python bench/reshard_cost.py --widths 1 2 --json out.json

Each size is the tiny SMELT recipe with ``model.hidden_size``, ``moe.expert_ffn_size`` and the
vocabulary widened by the factor (the S-XL recipes grow the same way: wider, more experts), on
one gloo rank. One process builds the engine training builds at ZeRO-1 (reference backend), takes one
optimizer step (so Adam's moments exist) and saves a checkpoint twice, with the layout-free state
(weights + moments, :func:`smelt_ds.runs.checkpoint.save` with ``optimizer_state``) and without it,
timing each. A second, fresh process builds the engine at another layout (ZeRO-0) and loads the
state into it (:func:`smelt_ds.runs.reshard.load_resharded`), timing it and sampling its memory
every 2 ms from ``/proc/self/status``:

* ``RssAnon``: anonymous memory. Its peak above the level before the load includes the new
  engine's own Adam moments, which the load creates (a fresh engine allocates them at its first
  step anyway: 8 bytes per parameter); that peak minus those moments is what the conversion
  itself holds, and its ratio to the largest tensor's state (weight + two moments, fp32) is the
  bound the design promises: the shards are memory-mapped and each parameter's values are read
  when written.
* ``RssFile``: file pages of the mapped shards, page cache the kernel reclaims under pressure; it
  grows with the checkpoint, which is what a memory-mapped read is.

Printed: parameters, the largest tensor, the state's bytes, save seconds with / without the state
(ratio), load seconds, the two memory peaks and their ratios, and a log-log fit of load seconds
against parameters with its extrapolation to the M, L and XL recipes (docs/changing_scale.md).
These are CPU stand-ins: the fit's exponent carries over, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = "recipes/tiny/smelt.yaml"


def overrides(width: int) -> list[str]:
    """The ``--set`` list of a size: tiny widened ``width`` times, ZeRO-1 on the reference backend."""
    from smelt_ds.config.loading import load_config

    cfg = load_config(ROOT / BASE)
    return [f"model.hidden_size={cfg.model.hidden_size * width}",
            f"moe.expert_ffn_size={cfg.moe.expert_ffn_size * width}",
            "moe_runtime.backend=reference", "deepspeed.zero_stage=1", "train.seq_len=32", "train.micro_batch_size=2"]


def _anon_file() -> tuple[int, int]:
    vals = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:")):
            k, v = line.split(":")
            vals[k] = int(v.split()[0]) * 1024
    return vals.get("RssAnon", 0), vals.get("RssFile", 0)


class _Peak:
    """Peak RssAnon / RssFile while the block runs, sampled every 2 ms by a thread."""

    def __enter__(self):
        self.base = _anon_file()
        self.peak = list(self.base)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            a, f = _anon_file()
            self.peak = [max(self.peak[0], a), max(self.peak[1], f)]
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        a, f = _anon_file()
        self.peak = [max(self.peak[0], a), max(self.peak[1], f)]


def _engine(sets: list[str]):
    import torch

    from smelt_ds.config.loading import load_config
    from smelt_ds.parallel.distributed import init_distributed
    from smelt_ds.train.build import build
    from smelt_ds.train.objective import total_loss

    init_distributed()
    cfg = load_config(ROOT / BASE, sets)
    built = build(cfg, 1)
    return cfg, built, torch, total_loss


def save_side(run_dir: str, sets: list[str]) -> dict[str, Any]:
    """Build, one step, save with and without the layout-free state: sizes and seconds."""
    from smelt_ds.runs import checkpoint as ckpt

    cfg, built, torch, total_loss = _engine(sets)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=g)
    built.engine.backward(total_loss(built.engine(ids[:, :-1], labels=ids[:, 1:]), cfg.train))
    built.engine.step()
    params = {n: p for n, p in built.engine.module.named_parameters()}
    times = {}
    for name, opt in (("without", False), ("with", True), ("without", False), ("with", True)):
        t0 = time.perf_counter()
        d = ckpt.save(built.engine, Path(run_dir) / name, 1, 0, {}, 1, built.layout, reference=True,
                      optimizer_state=opt)
        times.setdefault(name, []).append(time.perf_counter() - t0)
    shard_bytes = sum(p.stat().st_size for p in (d / "reference").glob("*.pt"))
    largest = max(p.numel() for p in params.values())
    return {"params": sum(p.numel() for p in params.values()), "largest_numel": largest,
            "shard_bytes": shard_bytes, "save_s_with": min(times["with"]), "save_s_without": min(times["without"]),
            "checkpoint": str(d)}


def load_side(ckpt_dir: str, sets: list[str]) -> dict[str, Any]:
    """A fresh engine at ZeRO-0, the layout-free state loaded into it: seconds and memory peaks."""
    from smelt_ds.runs.reshard import load_resharded

    cfg, built, _, _ = _engine([*sets, "deepspeed.zero_stage=0"])
    t0 = time.perf_counter()
    with _Peak() as peak:
        load_resharded(built, Path(ckpt_dir), cfg.moe_runtime.backend)
    opt = built.engine.optimizer
    state = getattr(opt, "optimizer", opt).state  # ZeRO-0: the torch optimizer (maybe wrapped)
    moments = sum(t.nbytes for st in state.values() for t in st.values() if hasattr(t, "nbytes") and t.dim() > 0)
    return {"load_s": time.perf_counter() - t0, "anon_peak": peak.peak[0] - peak.base[0] - moments,
            "moments_bytes": moments,
            "file_peak": peak.peak[1] - peak.base[1]}


def _child(mode: str, arg: str, sets: list[str]) -> dict[str, Any]:
    import os

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    out = subprocess.run([sys.executable, __file__, "--child", mode, arg, "--sets", json.dumps(sets)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if out.returncode:
        raise SystemExit(f"{mode} failed (exit {out.returncode}):\n{out.stdout[-1500:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def recipe_params() -> dict[str, int]:
    """Parameters of the S, M, L and XL SMELT recipes (the model built on the meta device)."""
    import torch

    from smelt_ds.config.loading import load_config
    from smelt_ds.model import SmeltLM

    out = {}
    for size in ("s", "m", "l", "xl"):
        cfg = load_config(ROOT / "recipes" / size / "smelt.yaml")
        with torch.device("meta"):
            m = SmeltLM(cfg.model, cfg.moe, cfg.loop)
        out[size.upper()] = sum(p.numel() for p in m.parameters())
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8], help="widening factors (default 1 2 4 8)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    p.add_argument("--sets", default="[]", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        mode, arg = args.child
        sets = json.loads(args.sets)
        print(json.dumps(save_side(arg, sets) if mode == "save" else load_side(arg, sets)))
        return []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in args.widths:
            sets = overrides(w)
            saved = _child("save", str(Path(tmp) / f"w{w}"), sets)
            loaded = _child("load", saved["checkpoint"], sets)
            state = 12 * saved["largest_numel"]
            rows.append({"width": w, **saved, **loaded, "largest_state_bytes": state,
                         "anon_over_largest": loaded["anon_peak"] / state,
                         "file_over_shards": loaded["file_peak"] / saved["shard_bytes"]})
    print(f"{'width':>5} {'params':>11} {'largest':>9} {'shards':>10} {'save+/save':>10} {'load s':>7} "
          f"{'conv peak':>10} {'/largest':>8} {'file peak':>10} {'/shards':>7}")
    for r in rows:
        print(f"{r['width']:>5} {r['params']:>11,} {r['largest_numel']:>9,} {r['shard_bytes'] / 2**20:>8.1f}MB "
              f"{r['save_s_with'] / r['save_s_without']:>10.2f} {r['load_s']:>7.2f} {r['anon_peak'] / 2**20:>8.1f}MB "
              f"{r['anon_over_largest']:>8.2f} {r['file_peak'] / 2**20:>8.1f}MB {r['file_over_shards']:>7.2f}")
    if len(rows) >= 2:
        xs = [math.log(r["params"]) for r in rows]
        ys = [math.log(r["load_s"]) for r in rows]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        print(f"load seconds ~ params^{slope:.2f} on these stand-ins; extrapolated (one CPU process, same machine):")
        last = rows[-1]
        rate = last["shard_bytes"] / last["load_s"]  # the largest size's bytes per second: linear, an upper bound
        for name, n in recipe_params().items():
            fit = last["load_s"] * (n / last["params"]) ** slope
            print(f"  {name:>2}: {n:>15,} params -> {fit:,.0f} s by the fit; "
                  f"{12 * n / rate:,.0f} s linear in the state's bytes ({12 * n / 1e9:,.0f} GB at "
                  f"{rate / 1e9:.2f} GB/s), divided among the ranks that read it")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
