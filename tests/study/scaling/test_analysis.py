"""The whole analysis (smelt_ds/study/scaling/analysis.py): degenerate input refused clearly, an
unfittable architecture reported, `smelt-ds scaling fit` on synthetic runs reproducing the closed-form
saving, the paired comparison against a hand-computed paired t interval."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from smelt_ds.errors import ConfigError
from smelt_ds.study.scaling.analysis import analyse, paired_comparison
from smelt_ds.study.scaling.collect import RunPoint
from smelt_ds.study.scaling.fit import fit_law
from smelt_ds.study.scaling.law import ScalingLaw
from tests.study.scaling.scaling_helpers import CHINCHILLA, fake_run, law_grid


def test_degenerate_inputs_are_clear_errors():
    with pytest.raises(ConfigError, match="2 distinct sizes"):
        fit_law([1e6] * 4, [1e5, 2e5, 4e5, 8e5], [5.0, 4.9, 4.8, 4.7])
    with pytest.raises(ConfigError, match="finite and positive"):
        fit_law([1e6, 2e6, 1e6, 2e6], [1e5, 1e5, 2e5, 2e5], [5.0, float("nan"), 4.8, 4.7])
    one_size = [RunPoint(f"r{i}", "baseline", 5.0 - 0.1 * i, 1e6, 1e5 * 2 ** i, 6e6) for i in range(4)]
    with pytest.raises(ConfigError, match="no architecture has enough finished runs") as info:
        analyse(one_size, n_bootstrap=0)
    assert "Paired runs" not in str(info.value)
    # a partial sweep (one token count): no fit, but the matched pairs are still reported
    partial = [RunPoint(f"b{i}", "baseline", 5.0, 1e6 * (i + 1), 1e5, 6e6, "none", f"s{i}", "d1") for i in range(2)]
    partial += [RunPoint(f"x{i}", "smelt", 4.9 + 0.1 * i, 1e6 * (i + 1), 1e5, 6e6, "middle", f"s{i}", "d1")
                for i in range(2)]
    with pytest.raises(ConfigError, match=r"Paired runs so far \(same size and budget, no fit\): smelt - baseline: "
                                          r"2 pair\(s\), mean loss delta -0\.0500 nats/token"):
        analyse(partial, n_bootstrap=0)


def test_analyse_reports_an_unfittable_architecture_and_fits_the_rest():
    N, D, L = law_grid(CHINCHILLA, 3, 3)
    good = [RunPoint(f"b{i}", "baseline", float(loss), float(n), float(d), 6 * float(n))
            for i, (n, d, loss) in enumerate(zip(N, D, L, strict=True))]
    lonely = [RunPoint("s0", "smelt", 3.0, 1e8, 1e10, 6e8, position="middle")]
    res = analyse(good + lonely, n_bootstrap=0)
    assert set(res["architectures"]) == {"baseline"}
    assert any(e["what"] == "architecture smelt" and "2 distinct sizes" in e["reason"] for e in res["excluded"])


def test_fit_cli_on_synthetic_runs_reproduces_the_closed_form_saving(tmp_path, capsys):
    # runs drawn without noise from two laws that differ only in A (A_smelt = 0.9 A), with
    # C = 6 N D for both: the report's saving must be 1 - 0.9^(1/alpha) at every compute
    from smelt_ds.cli import main

    r, k = 0.9, 6.0
    smelt = ScalingLaw(CHINCHILLA.E, r * CHINCHILLA.A, CHINCHILLA.alpha, CHINCHILLA.B, CHINCHILLA.beta)
    for arch, pos, law in (("baseline", "none", CHINCHILLA), ("smelt", "middle", smelt)):
        for n in np.geomspace(1e7, 1e10, 5):
            for d in np.geomspace(1e9, 1e12, 5):
                fake_run(tmp_path / "runs", arch, pos, float(n), float(d), float(law(n, d)), k * float(n))
    fake_run(tmp_path / "runs", "smelt", "middle", 1e8, 1e9, None, 6e8, name="unfinished")
    out = tmp_path / "report"
    assert main(["scaling", "fit", str(tmp_path / "runs"), "-o", str(out), "--bootstrap", "4",
                 "--c-range", "1e18", "1e24"]) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "scaling.json").read_text())
    s = res["architectures"]["smelt"]
    np.testing.assert_allclose(s["savings"]["saving"], 1 - r ** (1 / CHINCHILLA.alpha), atol=2e-3)
    assert s["params"]["alpha"] == pytest.approx(CHINCHILLA.alpha, rel=1e-3)
    fp = res["architectures"]["baseline"]["flops_per_token"]
    assert (fp["f0"], fp["f1"]) == pytest.approx((0.0, 6.0), abs=1e-6)
    lo, hi = s["savings_ci95"]
    assert all(a <= 1 - r ** (1 / CHINCHILLA.alpha) + 2e-3 and b >= 1 - r ** (1 / CHINCHILLA.alpha) - 2e-3
               for a, b in zip(lo, hi, strict=True))
    assert len(res["excluded"]) == 1 and "unfinished" in res["excluded"][0]["reason"]
    md = (out / "report.md").read_text()
    assert "saving over the measured compute range: +26.6% to +26.6%" in md
    # the paired (fit-free) comparison: each SMELT run against the Baseline run of the same N and D
    pr = s["paired"]
    expect = [(r - 1) * CHINCHILLA.A * n ** -CHINCHILLA.alpha for n in np.geomspace(1e7, 1e10, 5) for _ in range(5)]
    assert pr["n_pairs"] == 25 and pr["wins"] == 25
    assert pr["mean_delta"] == pytest.approx(float(np.mean(expect)), rel=1e-6)
    assert "## Paired runs: each architecture vs baseline" in md and f"{pr['mean_delta']:+.4f}" in md
    assert (out / "scaling_paired.png").is_file()
    assert f"paired runs vs baseline: mean loss delta {pr['mean_delta']:+.4f} [" in printed
    assert "over 25 pairs" in printed
    for arch, a in res["architectures"].items():  # the summary line ends with the identification verdict
        line = next(x for x in printed.splitlines() if x.startswith(f"{arch}: "))
        ident = a["identification"]
        assert line.endswith("; identified") if ident["identified"] else \
            line.endswith("; NOT identified: " + "; ".join(ident["shortfalls"]))
    assert (out / "scaling_savings.png").is_file() and (out / "scaling_loss_vs_flops.png").is_file()


def test_paired_comparison_equals_a_hand_computed_paired_t_interval():
    from scipy import stats

    base = [RunPoint(f"b{i}", "baseline", 5.0 + i, 1e6 * (i + 1), 1e5, 6e6, size=f"s{i}", budget="d1")
            for i in range(4)]
    deltas = [-0.10, -0.30, 0.05, -0.15]
    other = [RunPoint(f"x{i}", "smelt", 5.0 + i + d, 1.005e6 * (i + 1), 1e5, 6e6, size=f"s{i}", budget="d1")
             for i, d in enumerate(deltas)]
    other.append(RunPoint("x9", "smelt", 4.0, 9e9, 1e5, 6e6, size="s9", budget="d1"))   # no Baseline twin
    pr = paired_comparison(base, other)
    d = np.array(deltas)
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    assert pr["n_pairs"] == 4 and pr["unpaired"] == 1 and pr["wins"] == 3
    assert pr["mean_delta"] == pytest.approx(d.mean(), abs=1e-12)
    assert pr["ci95"] == pytest.approx([d.mean() - half, d.mean() + half], rel=1e-9)
    t = d.mean() / (d.std(ddof=1) / math.sqrt(len(d)))
    assert pr["p_value"] == pytest.approx(2 * stats.t.sf(abs(t), len(d) - 1), rel=1e-9)
    # without sweep labels, runs pair by equal D and N within 2%
    unlabeled = [RunPoint(p.run_dir, p.architecture, p.loss, p.N, p.D, p.flops_per_token) for p in other[:4]]
    base_u = [RunPoint(p.run_dir, p.architecture, p.loss, p.N, p.D, p.flops_per_token) for p in base]
    assert paired_comparison(base_u, unlabeled)["mean_delta"] == pytest.approx(d.mean(), abs=1e-12)
    assert paired_comparison(base, other[4:]) is None
