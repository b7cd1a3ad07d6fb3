"""Collecting runs (smelt_ds/study/scaling/collect.py): unfinished and diverged runs reported, bad paths
refused."""

from __future__ import annotations

import re

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


def test_an_unreadable_summary_stops_the_fit_naming_the_file_unless_skipped(tmp_path, capsys):
    """A truncated summary.json used to exclude its run and exit 0, the fit silently resting on fewer
    runs; now `scaling fit` exits 2 naming the file and the fix, and --skip-unreadable opts in to
    fitting without it (listed as excluded)."""
    import json

    from smelt_ds.cli import main

    runs = tmp_path / "runs"
    for n in (1e6, 2e6, 4e6):
        for d in (1e8, 2e8):
            fake_run(runs, "baseline", "none", n, d, 2.0 + 1e3 / n ** 0.3 + 1e3 / d ** 0.3, 6 * n)
    bad = fake_run(runs, "baseline", "none", 8e6, 1e8, 2.5, 48e6) / "summary.json"
    bad.write_text(bad.read_text()[:40])                               # truncated
    with pytest.raises(ConfigError) as e:
        collect_runs([runs])
    assert str(e.value).startswith(f"{bad} is not readable (JSONDecodeError: ")
    assert str(e.value).endswith("restore the file (or rerun the run), remove the run directory, or pass "
                                 "--skip-unreadable to fit without it (it is then listed as excluded)")
    out = tmp_path / "report"
    assert main(["scaling", "fit", str(runs), "-o", str(out), "--bootstrap", "0"]) == 2
    assert f"smelt-ds scaling: error: {bad} is not readable (JSONDecodeError: " in capsys.readouterr().err
    assert not out.exists()
    assert main(["scaling", "fit", str(runs), "-o", str(out), "--bootstrap", "0", "--skip-unreadable"]) == 0
    assert f"excluded: {bad.parent}: unreadable: {bad} is not readable (JSONDecodeError: " in capsys.readouterr().err
    res = json.loads((out / "scaling.json").read_text())
    assert res["architectures"]["baseline"]["n_runs"] == 6
    assert [e["what"] for e in res["excluded"]] == [str(bad.parent)]
    label = bad.parent / "sweep_run.json"
    label.write_text("[1, 2]")                                          # valid JSON, not a mapping
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(label))} is not readable \(holds a list, not a mapping\)"):
        collect_runs([runs])
