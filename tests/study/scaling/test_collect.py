"""Collecting runs (smelt_ds/study/scaling/collect.py): unfinished and diverged runs reported, bad paths
refused."""

from __future__ import annotations

import pytest

from smelt_ds.errors import ConfigError
from smelt_ds.study.scaling.collect import collect_runs
from tests.study.scaling.scaling_helpers import fake_run


def test_collect_runs_reports_unfinished_and_diverged_runs(tmp_path):
    fake_run(tmp_path, "baseline", "none", 1e6, 1e5, 5.0, 6e6)
    fake_run(tmp_path, "baseline", "none", 2e6, 1e5, float("nan"), 12e6)
    fake_run(tmp_path, "baseline", "none", 4e6, 1e5, None, 24e6)
    pts, excl = collect_runs([tmp_path, tmp_path / "baseline"])  # a run given twice counts once
    assert [(p.N, p.D, p.loss, p.C) for p in pts] == [(1e6, 1e5, 5.0, 6e11)]
    assert len(excl) == 2
    assert any("not a finite" in e.reason for e in excl) and any("unfinished" in e.reason for e in excl)
    with pytest.raises(ConfigError, match="does not exist"):
        collect_runs([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no run directory"):
        collect_runs([tmp_path / "empty"])
