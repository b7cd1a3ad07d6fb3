"""Scaling-law fits, frontiers and savings against closed forms and direct computations."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from smelt_ds.errors import ConfigError
from smelt_ds.study.scaling import (
    FlopsModel,
    RunPoint,
    ScalingLaw,
    analyse,
    bootstrap,
    compute_for_loss,
    compute_savings,
    envelope,
    fit_flops_model,
    fit_law,
    frontier,
    isoflop_profiles,
    paired_comparison,
)

# Chinchilla's Approach-3 estimate (Hoffmann et al. 2022, Eq. 10) as the known law
CHINCHILLA = ScalingLaw(E=1.69, A=406.4, alpha=0.34, B=410.7, beta=0.28)


def _grid(law, n_sizes=6, n_tokens=6, noise=0.0, seed=0):
    N, D = np.meshgrid(np.geomspace(1e7, 1e10, n_sizes), np.geomspace(1e9, 1e12, n_tokens))
    N, D = N.ravel(), D.ravel()
    L = law(N, D) * np.exp(np.random.default_rng(seed).normal(0, noise, N.shape)) if noise else law(N, D)
    return N, D, L


def _closed_form(law, k, C):
    """Chinchilla's frontier for C = k N D: N_opt = G (C/k)^(b/(a+b)), L* = E + K (C/k)^(-ab/(a+b))."""
    a, b = law.alpha, law.beta
    G = (a * law.A / (b * law.B)) ** (1 / (a + b))
    K = law.A * G ** -a + law.B * G ** b
    Cp = np.asarray(C) / k
    return law.E + K * Cp ** (-a * b / (a + b)), G * Cp ** (b / (a + b)), K, a * b / (a + b)


def test_fit_recovers_a_noiseless_law_exactly():
    fit = fit_law(*_grid(CHINCHILLA))
    for name in ("E", "A", "alpha", "B", "beta"):
        assert getattr(fit.law, name) == pytest.approx(getattr(CHINCHILLA, name), rel=1e-4), name
    assert fit.at_bound == []


def test_fit_recovers_a_noisy_law_within_stated_tolerances():
    # 0.5% multiplicative noise on 36 runs: exponents within 0.03, E within 3%, and the fitted law
    # predicts held-out losses (outside the grid by 3x in N and D) within 1%
    N, D, L = _grid(CHINCHILLA, noise=0.005, seed=1)
    fit = fit_law(N, D, L)
    assert abs(fit.law.alpha - CHINCHILLA.alpha) < 0.03
    assert abs(fit.law.beta - CHINCHILLA.beta) < 0.03
    assert fit.law.E == pytest.approx(CHINCHILLA.E, rel=0.03)
    for n, d in [(3e10, 3e12), (3e6, 3e8), (1e9, 5e10)]:
        assert fit.law(n, d) == pytest.approx(CHINCHILLA(n, d), rel=0.01)


def test_bootstrap_intervals_cover_the_true_exponents():
    N, D, L = _grid(CHINCHILLA, n_sizes=5, n_tokens=4, noise=0.005, seed=2)
    pts = [RunPoint(f"r{i}", "x", float(l), float(n), float(d), 6 * float(n))
           for i, (n, d, l) in enumerate(zip(N, D, L))]
    fits = {"x": fit_law(N, D, L)}
    boot = bootstrap({"x": pts}, fits, {"x": FlopsModel(0, 6)}, None, np.array([1e20]), n=20, seed=0)
    params = boot["x"]["params"]
    assert params.shape == (20, 5)
    lo, hi = np.percentile(params, [2.5, 97.5], axis=0)
    for i, true in enumerate([CHINCHILLA.E, CHINCHILLA.A, CHINCHILLA.alpha, CHINCHILLA.B, CHINCHILLA.beta]):
        if i in (2, 4):  # the exponents
            assert lo[i] <= true <= hi[i]


def test_frontier_equals_chinchilla_closed_form_for_C_equal_kND():
    C = np.geomspace(1e18, 1e25, 8)
    L, N, D = frontier(CHINCHILLA, FlopsModel(0.0, 6.0), C)
    L_cf, N_cf, _, _ = _closed_form(CHINCHILLA, 6.0, C)
    np.testing.assert_allclose(L, L_cf, rtol=1e-10)
    np.testing.assert_allclose(N, N_cf, rtol=1e-5)
    np.testing.assert_allclose(6 * N * D, C, rtol=1e-12)


def test_frontier_with_fixed_flops_per_token_equals_brute_force():
    # f(N) = f0 + f1 N with f0 > 0 (head and attention FLOPs): compare with a dense direct search
    fm = FlopsModel(2e6, 7.5)
    C = np.array([1e12, 1e15, 1e19])
    L, N, D = frontier(CHINCHILLA, fm, C)
    n = np.geomspace(1e2, 1e16, 400_001)
    for i, c in enumerate(C):
        vals = CHINCHILLA(n, c / fm(n))
        j = np.argmin(vals)
        assert L[i] == pytest.approx(vals[j], rel=1e-9)
        assert N[i] == pytest.approx(n[j], rel=1e-3)
        assert D[i] * fm(N[i]) == pytest.approx(c, rel=1e-12)
    # and the inverse: the compute needed to reach L*(C) is C
    np.testing.assert_allclose(compute_for_loss(CHINCHILLA, fm, L), C, rtol=1e-6)


def test_savings_for_laws_differing_in_A_equal_closed_form():
    # A_X = r A_B, C = k N D for both: L*_X(C) = E + r^(b/(a+b)) K (C/k)^-g, so at equal loss
    # C_X / C_B = r^(1/alpha) at every C, and the saving is 1 - r^(1/alpha).
    r, k = 0.9, 6.0
    other = ScalingLaw(CHINCHILLA.E, r * CHINCHILLA.A, CHINCHILLA.alpha, CHINCHILLA.B, CHINCHILLA.beta)
    C = np.geomspace(1e18, 1e25, 6)
    s = compute_savings(CHINCHILLA, FlopsModel(0, k), other, FlopsModel(0, k), C)
    np.testing.assert_allclose(s["saving"], 1 - r ** (1 / CHINCHILLA.alpha), rtol=1e-6)
    Lb, _, K, g = _closed_form(CHINCHILLA, k, C)
    Lo, _, Ko, _ = _closed_form(other, k, C)
    assert Ko / K == pytest.approx(r ** (CHINCHILLA.beta / (CHINCHILLA.alpha + CHINCHILLA.beta)), rel=1e-12)
    np.testing.assert_allclose(s["loss_delta"], Lo - Lb, rtol=1e-8)


def test_savings_for_laws_differing_in_E_equal_closed_form():
    # E_X = E_B - delta: E - delta + K (C_X/k)^-g = E + K (C_B/k)^-g
    # => C_X = k ((C_B/k)^-g + delta/K)^(-1/g): the saving grows with compute
    delta, k = 0.02, 6.0
    other = ScalingLaw(CHINCHILLA.E - delta, CHINCHILLA.A, CHINCHILLA.alpha, CHINCHILLA.B, CHINCHILLA.beta)
    C = np.geomspace(1e18, 1e25, 6)
    s = compute_savings(CHINCHILLA, FlopsModel(0, k), other, FlopsModel(0, k), C)
    _, _, K, g = _closed_form(CHINCHILLA, k, C)
    C_x = k * ((C / k) ** -g + delta / K) ** (-1 / g)
    np.testing.assert_allclose(s["C_other"], C_x, rtol=1e-6)
    np.testing.assert_allclose(s["saving"], 1 - C_x / C, rtol=1e-5)
    assert np.all(np.diff(s["saving"]) > 0)
    np.testing.assert_allclose(s["loss_delta"], -delta, rtol=1e-8)


def test_savings_from_flops_per_token_alone():
    # the same law but 10% more FLOPs per token: 10% more compute for every loss (saving -0.1)
    C = np.geomspace(1e18, 1e24, 4)
    s = compute_savings(CHINCHILLA, FlopsModel(0, 6.0), CHINCHILLA, FlopsModel(0, 6.6), C)
    np.testing.assert_allclose(s["saving"], -0.1, rtol=1e-6)
    Lb, _, K, g = _closed_form(CHINCHILLA, 6.0, C)
    np.testing.assert_allclose(s["loss_delta"], K * (C / 6.6) ** -g - K * (C / 6.0) ** -g, rtol=1e-8)


def test_unreachable_loss_gives_nan():
    assert math.isnan(compute_for_loss(CHINCHILLA, FlopsModel(0, 6), CHINCHILLA.E - 0.1)[0])


def test_flops_model_recovers_its_terms_and_reports_residuals():
    N = np.array([1e6, 2e6, 5e6, 9e6])
    fm = fit_flops_model(N, 3e6 + 2000.0 * np.sqrt(N) + 8.0 * N)
    assert (fm.f0, fm.fh, fm.f1) == pytest.approx((3e6, 2000.0, 8.0), rel=1e-6)
    assert fm.max_rel_residual < 1e-9
    two = fit_flops_model(N[:2], 3e6 + 8.0 * N[:2])  # two sizes: a line
    assert (two.f0, two.fh, two.f1) == pytest.approx((3e6, 0.0, 8.0), rel=1e-9)
    assert fit_flops_model(N[:1], [7e6]).f1 == pytest.approx(7.0)
    assert fit_flops_model(N, [1e7, 2e7, 1e7, 2e7]).max_rel_residual > 0.1


def test_flops_model_fits_real_budgets_of_a_width_family():
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.cost.budget import compute_budget

    cfgs = [config_from_dict({"model": {"hidden_size": h, "vocab_size": 4096, "max_seq_len": 128},
                              "moe": {"num_experts": 14, "top_k": 4, "expert_ffn_size": 3 * h // 4},
                              "loop": {"position": "none"}, "train": {"seq_len": 128}}) for h in (64, 96, 128, 160)]
    b = [compute_budget(c) for c in cfgs]
    fm = fit_flops_model([x.non_embedding_params for x in b], [x.train_flops_per_token for x in b])
    assert fm.max_rel_residual < 0.005  # the head's 6 H V FLOPs are the sqrt(N) term


def test_envelope_and_isoflop_profiles_against_direct_computation():
    law, k = CHINCHILLA, 6.0
    pts = []
    for C in (1e19, 1e20, 1e21):
        n_opt = _closed_form(law, k, C)[1]
        for n in n_opt * np.geomspace(1 / 5, 3, 9):  # sizes around the optimum, not centred on it
            pts.append(RunPoint("r", "x", float(law(n, C / (k * n))), float(n), C / (k * n), k * float(n)))
    env = envelope(pts)
    # direct: sorted by compute, each envelope run beats every cheaper run
    for p in env:
        assert all(q.loss > p.loss for q in pts if q.C < p.C * (1 - 1e-12))
    assert env[-1].loss == min(p.loss for p in pts)
    prof = isoflop_profiles(pts)
    assert len(prof) == 3
    _, N_cf, _, _ = _closed_form(law, k, np.array([g["C"] for g in prof]))
    for g, n in zip(prof, N_cf):
        assert g["N_opt"] == pytest.approx(n, rel=0.15)  # a parabola in log N approximates the profile
        assert g["N_opt"] != pytest.approx(n, rel=1e-3)  # ... but is not the closed form itself


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
    N, D, L = _grid(CHINCHILLA, 3, 3)
    good = [RunPoint(f"b{i}", "baseline", float(l), float(n), float(d), 6 * float(n))
            for i, (n, d, l) in enumerate(zip(N, D, L))]
    lonely = [RunPoint("s0", "smelt", 3.0, 1e8, 1e10, 6e8, position="middle")]
    res = analyse(good + lonely, n_bootstrap=0)
    assert set(res["architectures"]) == {"baseline"}
    assert any(e["what"] == "architecture smelt" and "2 distinct sizes" in e["reason"] for e in res["excluded"])


def _fake_run(root, arch, position, n, d, loss, fpt, name=None):
    run = root / arch / (name or f"n{n:.0f}-d{d:.0f}")
    run.mkdir(parents=True)
    (run / "sweep_run.json").write_text(json.dumps({"architecture": arch, "position": position}))
    if loss is not None:
        (run / "summary.json").write_text(json.dumps({
            "steps": 1, "tokens": d, "validation_loss": {"all": loss},
            "budget": {"non_embedding_params": n, "train_flops_per_token": fpt}}))
    return run


def test_collect_runs_reports_unfinished_and_diverged_runs(tmp_path):
    from smelt_ds.study.scaling import collect_runs

    _fake_run(tmp_path, "baseline", "none", 1e6, 1e5, 5.0, 6e6)
    _fake_run(tmp_path, "baseline", "none", 2e6, 1e5, float("nan"), 12e6)
    _fake_run(tmp_path, "baseline", "none", 4e6, 1e5, None, 24e6)
    pts, excl = collect_runs([tmp_path, tmp_path / "baseline"])  # a run given twice counts once
    assert [(p.N, p.D, p.loss, p.C) for p in pts] == [(1e6, 1e5, 5.0, 6e11)]
    assert len(excl) == 2
    assert any("not a finite" in e.reason for e in excl) and any("unfinished" in e.reason for e in excl)
    with pytest.raises(ConfigError, match="does not exist"):
        collect_runs([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no run directory"):
        collect_runs([tmp_path / "empty"])


def test_fit_cli_on_synthetic_runs_reproduces_the_closed_form_saving(tmp_path, capsys):
    # runs drawn without noise from two laws that differ only in A (A_smelt = 0.9 A), with
    # C = 6 N D for both: the report's saving must be 1 - 0.9^(1/alpha) at every compute
    from smelt_ds.cli import main

    r, k = 0.9, 6.0
    smelt = ScalingLaw(CHINCHILLA.E, r * CHINCHILLA.A, CHINCHILLA.alpha, CHINCHILLA.B, CHINCHILLA.beta)
    for arch, pos, law in (("baseline", "none", CHINCHILLA), ("smelt", "middle", smelt)):
        for n in np.geomspace(1e7, 1e10, 5):
            for d in np.geomspace(1e9, 1e12, 5):
                _fake_run(tmp_path / "runs", arch, pos, float(n), float(d), float(law(n, d)), k * float(n))
    _fake_run(tmp_path / "runs", "smelt", "middle", 1e8, 1e9, None, 6e8, name="unfinished")
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
               for a, b in zip(lo, hi))
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


def test_huber_objective_gradient_equals_finite_differences():
    from scipy.optimize import approx_fprime

    from smelt_ds.study.scaling import _objective, _objective_one

    rng = np.random.default_rng(0)
    logN, logD = np.log(rng.uniform(1e6, 1e9, 15)), np.log(rng.uniform(1e8, 1e11, 15))
    logL = np.log(rng.uniform(2.0, 4.0, 15))
    theta = np.array([5.0, 6.0, 0.8, 0.4, 0.3])
    lse = np.logaddexp(np.logaddexp(theta[0] - theta[3] * logN, theta[1] - theta[4] * logD), theta[2])
    r = np.abs(lse - logL)
    delta = float(np.median(r))  # half the residuals in the quadratic part, half in the linear part
    assert (r < delta).any() and (r > delta).any()
    val, grad = _objective_one(theta, logN, logD, logL, delta)
    num = approx_fprime(theta, lambda t: _objective_one(t, logN, logD, logL, delta)[0], 1e-7)
    np.testing.assert_allclose(grad, num, rtol=1e-5)
    # the one-theta objective equals the vectorised (grid) one
    v2, g2 = _objective(theta[None, :], logN, logD, logL, delta)
    assert v2[0] == pytest.approx(val, rel=1e-12)
    np.testing.assert_allclose(g2[0], grad, rtol=1e-10)
    # and the Huber loss itself: 0.5 r^2 inside delta, delta (|r| - delta/2) outside, over delta^2
    huber = np.where(r <= delta, 0.5 * r ** 2, delta * (r - delta / 2))
    assert val == pytest.approx(huber.sum() / delta ** 2, rel=1e-12)


def test_markdown_report_has_every_section_heading_in_order():
    from smelt_ds.study.scaling import report_markdown

    smelt = ScalingLaw(CHINCHILLA.E, 0.9 * CHINCHILLA.A, CHINCHILLA.alpha, CHINCHILLA.B, CHINCHILLA.beta)
    pts = [RunPoint(f"{arch}/{i}-{j}", arch, float(law(n, d)), float(n), float(d), 6 * float(n), pos, f"s{i}", f"d{j}")
           for arch, pos, law in (("baseline", "none", CHINCHILLA), ("smelt", "middle", smelt))
           for i, n in enumerate(np.geomspace(1e7, 1e10, 3)) for j, d in enumerate(np.geomspace(1e9, 1e12, 3))]
    res = analyse(pts, n_bootstrap=0, n_starts=4)
    md = report_markdown(res, {"loss vs training FLOPs": "scaling_loss_vs_flops.png"})
    headings = [line for line in md.splitlines() if line.startswith("#")]
    assert headings == ["# Scaling laws per architecture", "## Runs", "## Fits", "## Compute-optimal frontier",
                        "## Training FLOPs saved vs baseline",
                        "## Paired runs: each architecture vs baseline at the same size and budget (no fit)",
                        "## Envelope and IsoFLOP profiles", "## Figures"]
    assert md.endswith("![loss vs training FLOPs](scaling_loss_vs_flops.png)\n")
    # one architecture, no figures: the savings, paired and figure sections are left out, the rest stay in order
    md1 = report_markdown(analyse(pts[:9], n_bootstrap=0, n_starts=4), {})
    assert [line for line in md1.splitlines() if line.startswith("#")] == [
        "# Scaling laws per architecture", "## Runs", "## Fits", "## Compute-optimal frontier",
        "## Envelope and IsoFLOP profiles"]
