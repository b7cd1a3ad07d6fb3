"""The stop after too many skipped steps (exit 3) advises a resume with a lower peak LR or a higher
limit. Both are run settings a resume may change (smelt_ds.train.guards.RESUME_MAY_CHANGE), and the
advice, followed as printed, resumes through the real resume check and trains at the new LR."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from smelt_ds.config.loading import config_from_dict
from smelt_ds.parallel.engine import lr_multiplier
from smelt_ds.testing import scaled_timeout
from smelt_ds.testing.faults import fault_env
from tests import two_ranks

STEPS = 6


def _train(recipe: Path, *args: str, faults: list[str] | None = None) -> subprocess.CompletedProcess:
    """``python -m smelt_ds.train RECIPE ARGS...`` in one process (one rank)."""
    env = two_ranks.train_env(**(fault_env(faults) if faults else {}))
    return subprocess.run([sys.executable, "-m", "smelt_ds.train", str(recipe), *args], cwd=two_ranks.ROOT, env=env,
                          capture_output=True, text=True, timeout=scaled_timeout(300))


def _lrs(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["lr"] for r in rows if "lr" in r}


@pytest.mark.slow
def test_the_exit_3_advice_followed_as_printed_resumes_at_the_lower_lr(tmp_path):
    """NaN losses at steps 3 and 4 with at most 2 skips in a row: the run saves step 4 and exits 3,
    printing the resume to run. Run as printed (both --set of the advice), the resume passes the
    run-directory check (it used to be refused: ``train.lr: 0.003 in the run, 0.0015 in this
    recipe``), trains steps 5-6 at half the LR on the same schedule (logged LR = new peak x the
    schedule's multiplier, :func:`smelt_ds.parallel.engine.lr_multiplier`, at the schedule's
    position, which skipped steps do not advance; the checkpoint restores the old peak, which the
    resume must replace), and records the new values in config.yaml."""
    raw = two_ranks.recipe_raw(tmp_path / "run", tmp_path / "cache")
    raw["train"].update({"max_steps": STEPS, "save_every": 100, "step_guard": {"max_consecutive_skips": 2}})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    first = _train(recipe, faults=["nan:rank=0:step=3", "nan:rank=0:step=4"])
    assert first.returncode == 3, first.stderr[-3000:]
    assert "stopped at step 4 of 6 by 2 consecutive skipped steps" in first.stderr, first.stderr[-3000:]
    advice = re.findall(r"--resume auto --set (train\.lr=\S+|train\.step_guard\.max_consecutive_skips=\S+)",
                        first.stderr)
    assert advice == ["train.lr=0.0015", "train.step_guard.max_consecutive_skips=4"], first.stderr[-1500:]
    sets = [a for s in advice for a in ("--set", s)]
    second = _train(recipe, "--resume", "auto", *sets)
    assert second.returncode == 0, second.stderr[-3000:]
    f = lr_multiplier(config_from_dict(raw))
    lrs = _lrs(tmp_path / "run")
    assert sorted(lrs) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):  # a skipped step leaves the schedule where it was: steps 3-5 use f(2)
        peak, position = (3e-3 if s <= 4 else 1.5e-3), s - 1 - sum(1 for k in (3, 4) if k < s)
        assert lrs[s] == pytest.approx(peak * f(position), rel=1e-12), (s, lrs[s])
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]
    assert saved["lr"] == 1.5e-3 and saved["step_guard"]["max_consecutive_skips"] == 4
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / f"step{STEPS:08d}")
