#!/usr/bin/env python
"""Rewrite (on purpose) or check the golden loss curves in ``tests/assets/losses/``.

The golden curves are the first 50 optimizer steps of ``recipes/tiny/baseline.yaml`` and
``recipes/tiny/smelt.yaml`` trained on the built-in corpus, on CPU, in fp32, with one intra-op
thread and fixed seeds, each as one plain process (``python -m smelt_ds.train``) with a fresh data
cache (the built-in corpus, the tokenizer and the token shards are rebuilt, so a change in the data
pipeline shows as well). ``tests/train/test_golden_losses.py`` reruns them and compares with
:func:`compare`; this script is the one way to change the files:

    python scripts/update_golden_losses.py                 # rerun both, rewrite, print old vs new
    python scripts/update_golden_losses.py --case tiny_smelt
    python scripts/update_golden_losses.py --check         # rerun and compare only, write nothing
    python scripts/update_golden_losses.py --check --set train.lr=0.00301   # what a change does
    python scripts/update_golden_losses.py --check --perturb 512 --seed 1   # what rounding does (below)

Only numerics-neutral settings are added to the recipes besides ``train.max_steps=50``: the
recipes warm up over 50 steps, so with ``max_steps=50`` every step is a warmup step and the LR of
step ``s`` is ``lr * s / 50`` exactly as in the full 1000-step recipe (the cosine part, which
depends on ``max_steps``, is never reached): the 50 steps are *the* recipe's first 50 steps.
``log_every=1`` logs every step; evaluation and checkpoints happen only once, after step 50
(``eval_every``/``save_every`` large, one validation batch); the seeds and fp32 are pinned so that
a changed default cannot move the curves silently. The file records exactly the overrides used
and the test reruns with the file's own overrides (plus the temporary run and cache directories).

Runs of the cases go in parallel, one single-threaded process each (the thread count is part of
the numerics: torch's CPU reductions are split by thread, see ``NUM_THREADS``).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "tests" / "assets" / "losses"
FORMAT_VERSION = 1

#: case name -> recipe (relative to the repository root); the golden file is GOLDEN_DIR/<case>.json
CASES = {"tiny_baseline": "recipes/tiny/baseline.yaml", "tiny_smelt": "recipes/tiny/smelt.yaml"}

#: the overrides the golden runs use (the file records them; the test reads them from the file)
OVERRIDES = [
    "train.max_steps=50",          # = train.warmup_steps of both recipes: the LR is the full recipe's
    "train.log_every=1",           # a metrics row per step
    "train.eval_every=1000000",    # validation only after the last step (never before a logged loss)
    "train.save_every=1000000",    # one checkpoint, after the last step
    "eval.eval_batches=1",         # the final validation is not compared: keep it short
    "train.seed=1234",             # pinned (the defaults), so a changed default shows as a recipe change
    "data.seed=1234",
    "train.precision=fp32",        # what `auto` resolves to on CPU
]

#: intra-op threads of the golden runs. Measured: 2 threads instead of 1 change grad_norm at step 1
#: (relative 3e-8) and the loss from step ~28 on (relative 6e-4 by step 46). One thread also keeps
#: a shared 2-core machine from being oversubscribed when both cases run at once.
NUM_THREADS = 1

#: keys compared by the test (grad_norm is recorded but not compared: near-tied top-k routing makes
#: it jump by up to 20% between runs whose losses agree to 6e-4, see the report in the test module)
COMPARED = ("loss", "lm_loss")
RECORDED = ("loss", "lm_loss", "grad_norm", "lr")

# Tolerance on loss and lm_loss, relative: RTOL_START at step 1, multiplied by RTOL_GROWTH per step
# (rounding differences are amplified by training, roughly geometrically, until near-tied routing
# decisions flip and the curves decorrelate), capped at RTOL_MAX. Derived from the loss's sensitivity
# to rounding, not from one machine's rerun: `--perturb 512` multiplies every leaf module's output and
# its gradient by (1 +- 512u) at every step (u = 2^-24; 512u is the probabilistic bound
# lambda sqrt(k) u of a dot product of length k <= 2600 at lambda = 10 (Higham & Mary 2019), i.e.
# another summation order or BLAS kernel at its bound, everywhere at once). Seeds 0-3 of that, and
# 2u, 64u, AVX2 kernels (MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2) and another CPU
# (Intel Xeon vs the AMD EPYC of the files), moved the loss of either recipe by at most
# 1.1e-6 at step 1, 4.3e-6 to step 9, 2e-5 at step 10, 5.5e-5 at step 20, 2.3e-3 at step 33 and
# 2.1e-2 (step 41, the largest): every bound below is >= 3x that envelope at every step (step 10
# sets the growth, step 41 the cap). See tests/train/test_golden_losses.py for what it still catches.
RTOL_START = 1e-5
RTOL_GROWTH = 1.25
RTOL_MAX = 7e-2
#: absolute floor (nats): one ulp of a loss of 8 nats in fp32 (9.5e-7)
ATOL = 1e-6
#: fp32 unit roundoff, the unit of `--perturb`
FP32_U = 2.0 ** -24
#: the LR is computed in Python from the schedule: it must match to rounding
LR_RTOL = 1e-9


def rtol(step: int) -> float:
    """Relative tolerance on loss and lm_loss at optimizer step ``step`` (1-based)."""
    return min(RTOL_MAX, RTOL_START * RTOL_GROWTH ** (step - 1))


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------


def run_env() -> dict[str, str]:
    """Environment of a golden run: CPU only, NUM_THREADS intra-op threads, repository on the path."""
    env = dict(os.environ)
    env.update({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(NUM_THREADS), "MKL_NUM_THREADS": str(NUM_THREADS),
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)})
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SMELT_DS_CACHE"):
        env.pop(k, None)
    return env


def start_run(recipe: str, overrides: list[str], workdir: Path,
              perturb: tuple[float, int] | None = None) -> tuple[subprocess.Popen, Path]:
    """Start ``python -m smelt_ds.train recipe`` with ``overrides`` in ``workdir`` (fresh run and
    data cache directories under it); ``perturb`` = ``(c, seed)`` trains under
    :func:`perturb_leaf_outputs` instead. Returns the process and its log file."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "smelt_ds.train", str(ROOT / recipe)]
    if perturb is not None:
        cmd[1:3] = [__file__, PERTURBED_TRAIN, f"{perturb[0]}:{perturb[1]}"]
    for o in [*overrides, f"data.cache_dir={workdir / 'cache'}", f"train.run_dir={workdir / 'run'}"]:
        cmd += ["--set", o]
    log = workdir / "train.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=run_env(), stdout=f, stderr=subprocess.STDOUT)
    return proc, log


def read_run(workdir: Path) -> dict[str, Any]:
    """Per-step rows (``RECORDED`` keys) of a finished run in ``workdir``, and a data fingerprint."""
    rows = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [{"step": r["step"], **{k: r[k] for k in RECORDED}} for r in rows if "loss" in r]
    return {"steps": steps, "data": data_fingerprint(workdir)}


def data_fingerprint(workdir: Path) -> dict[str, Any] | None:
    """sha256 of the tokenizer and of every token shard the run used (from the prepared cache's
    ``meta.json``), to tell a data change from a model change when curves differ; None if unknown."""
    try:
        metas = sorted((workdir / "cache" / "prepared").glob("*/meta.json"))
        meta = json.loads(metas[0].read_text())
        return {"tokenizer_sha256": meta["tokenizer"]["sha256"],
                "shards_sha256": {s["file"]: s["sha256"] for s in meta["shards"]}}
    except Exception:  # noqa: BLE001 - diagnostic only
        return None


def run_cases(cases: dict[str, list[str]], workroot: Path, timeout_s: float = 1200.0,
              perturb: tuple[float, int] | None = None) -> dict[str, dict[str, Any]]:
    """Train every ``case -> overrides`` at once (one process each) under ``workroot``
    (``perturb``: see :func:`start_run`).

    Returns ``case -> {"steps", "data", "seconds", "workdir"}``. Raises RuntimeError naming the
    case and the tail of its log when a run fails or exceeds ``timeout_s`` seconds.
    """
    started = {}
    for name, overrides in cases.items():
        proc, log = start_run(CASES[name], overrides, workroot / name, perturb)
        started[name] = (proc, log, time.perf_counter())
    deadline = time.monotonic() + timeout_s
    out: dict[str, dict[str, Any]] = {}
    try:
        while len(out) < len(started):
            for name, (proc, log, t0) in started.items():
                if name in out or proc.poll() is None:
                    continue
                if proc.returncode != 0:
                    raise RuntimeError(f"golden run {name} ({CASES[name]}) exited with {proc.returncode}; "
                                       f"log {log}:\n" + _tail(log))
                out[name] = {**read_run(workroot / name), "seconds": time.perf_counter() - t0,
                             "workdir": str(workroot / name)}
            if len(out) < len(started):
                if time.monotonic() > deadline:
                    late = [n for n in started if n not in out]
                    raise RuntimeError(f"golden run(s) {late} did not finish within {timeout_s:g} s; log "
                                       f"{started[late[0]][1]}:\n" + _tail(started[late[0]][1]))
                time.sleep(0.2)
        out = {name: out[name] for name in started}
    finally:
        for proc, _, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


#: first argument of this script's perturbed training mode (used by start_run only)
PERTURBED_TRAIN = "--perturbed-train"


def perturb_leaf_outputs(c: float, seed: int) -> None:
    """From now on, multiply every leaf module's floating-point output, and the gradient that flows
    back into it, element-wise by ``1 + c * FP32_U * xi`` (``xi`` = +-1 at random from ``seed``): an
    extra error of ``c`` units of roundoff on every projection, norm, router and expert output at
    every step, a model of another machine's summation order (see RTOL_GROWTH)."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def scale(t):
        xi = torch.randint(0, 2, t.shape, generator=gen).to(t.dtype) * 2 - 1
        return t * (1 + c * FP32_U * xi)

    def hook(module, args, out):
        if next(module.children(), None) is not None or not isinstance(out, torch.Tensor):
            return None
        if not (out.is_floating_point() and out.requires_grad):
            return None
        out = scale(out)
        out.register_hook(scale)
        return out

    torch.nn.modules.module.register_module_forward_hook(hook)


def _tail(log: Path, n: int = 4000) -> str:
    text = log.read_text(errors="replace").replace("\r", "\n")
    return "\n".join(line for line in text[-n:].splitlines() if line.strip())


# ---------------------------------------------------------------------------------------------
# golden files
# ---------------------------------------------------------------------------------------------


def golden_path(case: str) -> Path:
    return GOLDEN_DIR / f"{case}.json"


def load_golden(case: str) -> dict[str, Any]:
    return json.loads(golden_path(case).read_text())


def versions() -> dict[str, str]:
    import deepspeed
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "platform": platform.platform(), "machine": platform.machine(), "processor": _cpu_model()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def golden_document(case: str, overrides: list[str], run: dict[str, Any]) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "case": case,
        "recipe": CASES[case],
        "recipe_sha256": sha256_file(ROOT / CASES[case]),
        "overrides": list(overrides),
        "command": f"python -m smelt_ds.train {CASES[case]} " + " ".join(f"--set {o}" for o in overrides)
                   + " --set data.cache_dir=<fresh temp dir> --set train.run_dir=<fresh temp dir>",
        "env": {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(NUM_THREADS), "device": "cpu", "processes": 1},
        "versions": versions(),
        "written": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "written_by": "scripts/update_golden_losses.py",
        "data": run["data"],
        "steps": run["steps"],
    }


def dump_golden(doc: dict[str, Any]) -> str:
    """JSON with one line per step, so that a rewrite diffs step by step."""
    head = {k: v for k, v in doc.items() if k != "steps"}
    text = json.dumps(head, indent=2)[:-2]  # drop the closing "\n}"
    rows = ",\n".join("    " + json.dumps(r) for r in doc["steps"])
    return f'{text},\n  "steps": [\n{rows}\n  ]\n}}\n'


def write_golden(case: str, doc: dict[str, Any]) -> None:
    path = golden_path(case)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dump_golden(doc))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# comparing
# ---------------------------------------------------------------------------------------------


def _close(a: float, b: float, rel: float, atol: float = ATOL) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= atol + rel * abs(b)


def compare(golden: list[dict[str, Any]], fresh: list[dict[str, Any]], exact: bool = False) -> list[str]:
    """Problems of ``fresh`` per-step rows against ``golden`` rows, first differing step first
    (empty: within tolerance). Compares the step numbers, ``lr`` (LR_RTOL) and COMPARED keys
    (:func:`rtol` of the step, plus ATOL); ``exact``: every compared value must be bit-identical
    (what a pure refactor gives on the machine that wrote the files)."""
    problems = []
    if [r["step"] for r in fresh] != [r["step"] for r in golden]:
        problems.append(f"logged steps differ: golden {_span(golden)}, fresh run {_span(fresh)}")
    # the common prefix: a differing number of steps is reported above
    for g, f in zip(golden, fresh, strict=False):
        s = g["step"]
        tol = 0.0 if exact else rtol(s)
        for key in COMPARED:
            if not _close(f[key], g[key], tol, atol=0.0 if exact else ATOL):
                problems.append(f"step {s} {key}: golden {g[key]!r}, fresh {f[key]!r} (relative difference "
                                f"{_relative_difference(f[key], g[key]):.3g} > tolerance {tol:.3g})")
        if not _close(f["lr"], g["lr"], 0.0 if exact else LR_RTOL, atol=0.0):
            problems.append(f"step {s} lr: golden {g['lr']!r}, fresh {f['lr']!r} (the LR schedule changed)")
    return problems


def _span(rows: list[dict[str, Any]]) -> str:
    return f"{len(rows)} rows, steps {rows[0]['step']}..{rows[-1]['step']}" if rows else "no rows"


def _relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def summary(golden: list[dict[str, Any]], fresh: list[dict[str, Any]]) -> str:
    """Max relative differences per key, the first step with any difference, and the final losses."""
    lines = []
    for key in RECORDED:
        # the common prefix: compare() reports a differing number of steps
        diffs = [(_relative_difference(f[key], g[key]), g["step"]) for g, f in zip(golden, fresh, strict=False)]
        worst, at = max(diffs, default=(0.0, None))
        first = next((s for d, s in diffs if d > 0), None)
        lines.append(f"  {key:9s} max relative difference {worst:.3g}" + (f" (step {at})" if worst else "")
                     + (f", first different at step {first}" if first else ", bit-identical"))
    if golden and fresh:
        lines.append(f"  final loss: golden {golden[-1]['loss']:.6f}, fresh {fresh[-1]['loss']:.6f}")
    return "\n".join(lines)


def explain(case: str, doc: dict[str, Any], fresh_data: dict[str, Any] | None) -> list[str]:
    """Hints on why a curve may differ: recipe file, versions, data changed since it was written."""
    notes = []
    if doc.get("recipe_sha256") != sha256_file(ROOT / doc["recipe"]):
        notes.append(f"{doc['recipe']} changed since the golden file was written")
    now = versions()
    for k in ("torch", "deepspeed", "processor"):
        if doc.get("versions", {}).get(k) != now[k]:
            notes.append(f"{k}: golden {doc.get('versions', {}).get(k)!r}, now {now[k]!r}")
    if fresh_data is not None and doc.get("data") is not None and fresh_data != doc["data"]:
        what = "tokenizer" if fresh_data["tokenizer_sha256"] != doc["data"]["tokenizer_sha256"] else "token shards"
        notes.append(f"the data changed: the {what} differ from the golden run's (a data-pipeline change)")
    return notes


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", choices=sorted(CASES), help="only this case (repeatable); default all")
    p.add_argument("--check", action="store_true", help="rerun and compare with the golden files; write nothing")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra override on top of the golden ones (only with --check: to see what a change does)")
    p.add_argument("--exact", action="store_true", help="with --check: require bit-identical loss, lm_loss and lr")
    p.add_argument("--keep", metavar="DIR", help="run in DIR and keep the run directories (default: a temp dir)")
    p.add_argument("--perturb", type=float, metavar="C",
                   help="with --check: train with every leaf module's output and gradient multiplied by "
                        "(1 +- C * 2^-24) at random (the rounding sensitivity behind RTOL_GROWTH)")
    p.add_argument("--seed", type=int, default=0, help="with --perturb: the seed of the random signs")
    args = p.parse_args(argv)
    if args.set and not args.check:
        p.error("--set changes the runs, so it is only allowed with --check: the golden files hold the tiny "
                "recipes with the overrides in OVERRIDES (edit OVERRIDES to change them on purpose)")
    if args.perturb is not None and not args.check:
        p.error("--perturb changes the arithmetic, so it is only allowed with --check")
    names = args.case or list(CASES)
    olds = {n: load_golden(n) if golden_path(n).is_file() else None for n in names}
    overrides = {n: (olds[n]["overrides"] if args.check and olds[n] else OVERRIDES) + args.set for n in names}
    if args.check and any(olds[n] is None for n in names):
        p.error(f"--check: no golden file for {[n for n in names if olds[n] is None]}: write them first")

    with tempfile.TemporaryDirectory(prefix="golden-losses-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        print(f"training {', '.join(names)} (50 steps each, CPU, in parallel) in {root} ...", flush=True)
        runs = run_cases(overrides, root, perturb=None if args.perturb is None else (args.perturb, args.seed))
    status = 0
    for n in names:
        run, old = runs[n], olds[n]
        print(f"\n{n} ({CASES[n]}): {len(run['steps'])} steps in {run['seconds']:.1f} s")
        if old is not None:
            print(f"old vs new:\n{summary(old['steps'], run['steps'])}")
            problems = compare(old["steps"], run["steps"], exact=args.exact)
            print(f"  {'within' if not problems else 'OUTSIDE'} the test's "
                  f"{'exact check' if args.exact else 'tolerance'}"
                  + (f": {len(problems)} problems, first: {problems[0]}" if problems else ""))
            for note in explain(n, old, run["data"]):
                print(f"  note: {note}")
            status |= bool(problems)
        if not args.check:
            write_golden(n, golden_document(n, overrides[n], run))
            print(f"  wrote {golden_path(n).relative_to(ROOT)}")
    return status if args.check else 0


if __name__ == "__main__":
    if sys.argv[1:2] == [PERTURBED_TRAIN]:  # python update_golden_losses.py --perturbed-train C:SEED RECIPE ...
        c, seed = sys.argv[2].split(":")
        perturb_leaf_outputs(float(c), int(seed))
        from smelt_ds.train.loop import main as train_main

        sys.exit(train_main(sys.argv[3:]))
    sys.exit(main())
