"""Replicate runs (the sweep's ``seeds``) in the scaling analysis: averaged into one point per design
point before the fits, paired seed by seed, their spread reported; checked against hand computations
on synthetic summaries read back from run directories."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from smelt_ds.study.scaling import analyse, collect_runs
from smelt_ds.study.scaling.fit import fit_law

from .scaling_helpers import CHINCHILLA

SIZES = {"s0": 2e6, "s1": 5e6, "s2": 1.2e7, "s3": 3e7}
BUDGETS = {"b0": 2e8, "b1": 8e8, "b2": 3.2e9}
# a fixed, uneven pattern of deviations from the law (nats/token), so that the fit depends on how
# the replicates are weighed; seeds 1 and 2 at budget b1
WIGGLE = {"s0": 0.011, "s1": -0.007, "s2": 0.004, "s3": -0.013}
SEED_DEV = {1: 0.021, 2: -0.006}
SMELT_GAIN = {"s0": -0.010, "s1": -0.030, "s2": 0.005, "s3": -0.020}


def _loss(arch: str, size: str, budget: str, seed: int | None) -> float:
    loss = float(CHINCHILLA(SIZES[size], BUDGETS[budget])) + WIGGLE[size] * (1 + list(BUDGETS).index(budget))
    loss += SEED_DEV[seed] if seed is not None else 0.0
    return loss + (SMELT_GAIN[size] * (1.5 if seed == 2 else 1.0) if arch == "smelt" else 0.0)


def _write_runs(root: Path) -> None:
    for arch in ("baseline", "smelt"):
        for size, n in SIZES.items():
            for budget, d in BUDGETS.items():
                for seed in ([1, 2] if budget == "b1" else [None]):
                    run = root / arch / (f"{size}-{budget}" + (f"-s{seed}" if seed else ""))
                    run.mkdir(parents=True)
                    (run / "sweep_run.json").write_text(json.dumps(
                        {"architecture": arch, "position": "none" if arch == "baseline" else "middle",
                         "size": size, "budget": budget, "seed": seed}))
                    (run / "summary.json").write_text(json.dumps(
                        {"steps": 1, "tokens": d, "validation_loss": {"all": _loss(arch, size, budget, seed)},
                         "budget": {"non_embedding_params": n, "train_flops_per_token": 6 * n}}))


@pytest.mark.slow
def test_replicates_are_averaged_before_the_fit_and_paired_seed_by_seed(tmp_path):
    from scipy import stats

    _write_runs(tmp_path)
    points, excluded = collect_runs([tmp_path])
    assert not excluded and len(points) == 2 * 4 * 4
    res = analyse(points, n_bootstrap=0)
    for arch in ("baseline", "smelt"):
        # the hand computation: one point per (size, budget) in the order the runs were read,
        # the two seeds' mean loss at b1
        order: list[tuple[str, str]] = []
        losses: dict[tuple[str, str], list[float]] = {}
        for p in points:
            if p.architecture == arch:
                key = (p.size, p.budget)
                order += [key] if key not in losses else []
                losses.setdefault(key, []).append(p.loss)
        means = [sum(losses[k]) / len(losses[k]) for k in order]
        assert [len(losses[k]) for k in order].count(2) == 4
        ref = fit_law([SIZES[s] for s, _ in order], [BUDGETS[b] for _, b in order], means, n_starts=32)
        assert res["architectures"][arch]["params"] == ref.law.as_dict()
        assert res["architectures"][arch]["n_runs"] == 12
        # replicate spread: pooled sample SD of the losses between seeds at the 4 points of b1
        rep = res["architectures"][arch]["replicates"]
        pooled = math.sqrt(sum((a - b) ** 2 / 2 for a, b in (losses[(s, "b1")] for s in SIZES)) / 4)
        assert rep["points"] == 4 and rep["pooled_sd"] == pytest.approx(pooled, rel=1e-12)

    pr = res["architectures"]["smelt"]["paired"]
    # deltas per design point: the mean over its seeds of (smelt - baseline), seed by seed
    deltas = {(s, b): [_loss("smelt", s, b, seed) - _loss("baseline", s, b, seed)
                       for seed in ([1, 2] if b == "b1" else [None])] for s in SIZES for b in BUDGETS}
    d = np.array([np.mean(v) for v in deltas.values()])
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    assert pr["n_pairs"] == 12 and pr["n_runs_pairs"] == 16 and pr["unpaired"] == 0
    assert pr["mean_delta"] == pytest.approx(d.mean(), abs=1e-12)
    assert pr["ci95"] == pytest.approx([d.mean() - half, d.mean() + half], rel=1e-9)
    seed_sd = math.sqrt(sum((v[0] - v[1]) ** 2 / 2 for v in deltas.values() if len(v) == 2) / 4)
    assert pr["replicated_points"] == 4 and pr["seed_sd"] == pytest.approx(seed_sd, rel=1e-9)
    assert pr["by_budget"]["b1"] == pytest.approx(np.mean([np.mean(deltas[(s, "b1")]) for s in SIZES]), abs=1e-12)


@pytest.mark.slow
def test_the_fit_command_recomputes_the_report_from_summaries_alone(tmp_path, capsys):
    from smelt_ds.cli import main

    _write_runs(tmp_path / "runs")
    assert main(["scaling", "fit", str(tmp_path / "runs"), "-o", str(tmp_path / "report"), "--bootstrap", "4"]) == 0
    res = json.loads((tmp_path / "report" / "scaling.json").read_text())
    pr = res["architectures"]["smelt"]["paired"]
    md = (tmp_path / "report" / "report.md").read_text()
    assert f"| smelt | 12 (16) | {pr['mean_delta']:+.4f} [" in md
    assert f"| {pr['seed_sd']:.4f} (4 points) |" in md
