"""Start-up time of ``smelt-ds`` commands, next to Python itself and ``import torch``.

    python bench/cli_startup.py [--repeats 7]

Each command runs ``--repeats`` times, each time in a fresh process, the commands taking turns (so
a load spike on a shared machine hits all of them alike); printed: the median wall time of each,
and its ratio to ``python -c pass`` (the interpreter's own start) and to ``python -c "import
torch"``. ``smelt-ds --help`` imports no package of the stack (aim: well under 1 s); ``budget``
needs pydantic and PyYAML only; ``memory`` also torch (tests/test_cli.py asserts which modules
each imports, this prints what that costs). ``import smelt_ds, deepspeed`` against ``import
deepspeed``: what smelt_ds/import_hooks.py saves every rank (DeepSpeed's autotuner's optional
MLflow import; equal when MLflow is not installed). Output of the commands is discarded; a command that
fails is reported with its exit status.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny/smelt.yaml"


def commands() -> dict[str, list[str]]:
    smelt = [shutil.which("smelt-ds") or sys.executable, *([] if shutil.which("smelt-ds") else ["-m", "smelt_ds.cli"])]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "python -c 'import deepspeed'": [sys.executable, "-c", "import deepspeed"],
        "python -c 'import smelt_ds, deepspeed'": [sys.executable, "-c", "import smelt_ds, deepspeed"],
        "smelt-ds --help": [*smelt, "--help"],
        f"smelt-ds budget {RECIPE}": [*smelt, "budget", RECIPE],
        f"smelt-ds memory {RECIPE}": [*smelt, "memory", RECIPE],
    }


def _time(cmd: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    return time.perf_counter() - t0, rc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7, help="fresh processes per command (default 7)")
    args = p.parse_args()
    cmds = commands()
    times: dict[str, list[float]] = {name: [] for name in cmds}
    failed: dict[str, int] = {}
    _time(cmds["python -c 'import torch'"])  # warm the file cache once, untimed
    for _ in range(args.repeats):
        for name, cmd in cmds.items():
            dt, rc = _time(cmd)
            times[name].append(dt)
            if rc not in (0, 3):  # memory exits 3 when the recipe's setting does not fit
                failed[name] = rc
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base, torch_s = med["python -c pass"], med["python -c 'import torch'"]
    width = max(map(len, cmds))
    print(f"{'command'.ljust(width)}  median (s)  x python  x import torch   ({args.repeats} fresh processes each)")
    for name in cmds:
        note = f"   exit status {failed[name]}" if name in failed else ""
        print(f"{name.ljust(width)}  {med[name]:10.3f}  {med[name] / base:8.1f}  {med[name] / torch_s:14.2f}{note}")


if __name__ == "__main__":
    main()
