"""Stratified comparisons (smelt_ds.eval.stratified) on synthetic per-example records: the point
difference against a hand computation, the paired bootstrap interval against constant shifts,
known effects, the normal-approximation width and an unpaired bootstrap, bucket and k strata
against hand counts, the report's wording, the plots and every input error."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from smelt_ds.errors import ConfigError
from smelt_ds.eval.stratified import (
    MAX_LENGTH_BUCKETS,
    MIN_BUCKET_EXAMPLES,
    POOL_STRIDE,
    _rng_kwargs,
    plot_stratified,
    pool_tasks,
    stratified_markdown,
    stratify,
    write_stratified,
)
from tests.eval.eval_test_utils import png_not_blank, png_size


def _recs(run: str, values, task: str = "t", metric: str = "acc", k: int = 0, lengths=None, doc_ids=None) -> list:
    values = list(values)
    doc_ids = list(range(len(values))) if doc_ids is None else list(doc_ids)
    lengths = [10] * len(values) if lengths is None else list(lengths)
    return [{"run": run, "task": task, "num_fewshot": k, "doc_id": int(d), "length_tokens": int(n), "metric": metric,
             "value": float(v)} for d, n, v in zip(doc_ids, lengths, values, strict=True)]


def _pair(base, run, **kw) -> list:
    return _recs("base", base, **kw) + _recs("smelt", run, **kw)


def _only_row(res: dict, stratum: str = "k") -> dict:
    (c,) = res["comparisons"]
    rows = c["fewshot" if stratum == "k" else "length"]["rows"]
    assert len(rows) == 1
    return rows[0]


# ---------------------------------------------------------------------------------------------
# the paired difference and its interval
# ---------------------------------------------------------------------------------------------


def test_point_difference_is_the_hand_computed_mean_of_paired_differences():
    rng = np.random.default_rng(3)
    base, run = rng.normal(2.0, 1.0, 9), rng.normal(1.8, 1.0, 9)
    ids = rng.permutation(100)[:9]
    recs = _pair(base, run, metric="loss", doc_ids=ids)
    recs.reverse()  # input order must not matter: pairs are taken in doc_id order
    row = _only_row(stratify(recs, "base", n_resamples=200))
    order = np.argsort(ids)
    assert row["difference"] == float(np.mean(run[order] - base[order]))
    assert row["mean_run"] == float(np.mean(run[order]))
    assert row["mean_baseline"] == float(np.mean(base[order]))
    assert row["n"] == 9 and row["better"] == "lower"
    assert row["low"] < row["difference"] < row["high"]


def test_pooled_tasks_pair_within_each_task_and_weigh_every_example_the_same():
    """Two tasks share doc ids 0-1: pooled, the four pairs stay apart (n = 4) and the difference
    is the mean of the four paired differences, (1 + 1 + 0 + 2) / 4 = 1; the other metric and
    the unlisted task are not pooled; the input records are unchanged."""
    recs = (_pair([0, 0], [1, 1], task="a", metric="bpb") + _pair([5, 3], [5, 5], task="b", metric="bpb")
            + _pair([0, 0], [9, 9], task="a", metric="acc") + _pair([0, 0], [9, 9], task="c", metric="bpb"))
    before = json.dumps(recs)
    pooled = pool_tasks(recs, {"pooled": ["a", "b"]}, "bpb")
    assert json.dumps(recs) == before
    assert sorted(r["doc_id"] for r in pooled if r["run"] == "base") == [0, 1, POOL_STRIDE, POOL_STRIDE + 1]
    res = stratify(pooled, "base", n_resamples=200)
    row = _only_row(res)
    assert (row["task"], row["n"], row["difference"]) == ("pooled", 4, 1.0)
    with pytest.raises(ConfigError, match="'a' .*also a task"):
        pool_tasks(recs, {"a": ["b"]}, "bpb")


def test_constant_shift_gives_a_point_interval_that_excludes_zero():
    base = np.random.default_rng(0).random(50)
    row = _only_row(stratify(_pair(base, base + 0.1, metric="loss"), "base"))
    assert row["interval"] == "constant differences"
    assert row["low"] == row["high"] == pytest.approx(0.1, abs=1e-12)
    assert row["difference"] == pytest.approx(0.1, abs=1e-12)
    assert row["interval_includes_zero"] is False
    # identical runs: every difference is 0, the interval is [0, 0] and includes 0
    same = _only_row(stratify(_pair(base, base), "base"))
    assert (same["low"], same["high"], same["interval_includes_zero"]) == (0.0, 0.0, True)


def test_known_effect_is_found_and_noise_is_not():
    n, effect, sd = 400, 0.3, 1.0
    rng = np.random.default_rng(7)
    base = rng.normal(0.0, 2.0, n)
    noise = rng.normal(0.0, sd, n)
    noise -= noise.mean()  # sample mean of the differences is exactly `effect` (resp. 0)
    row = _only_row(stratify(_pair(base, base + effect + noise), "base", n_resamples=2000))
    assert row["interval"] == "BCa"
    assert row["low"] > 0 and not row["interval_includes_zero"]
    assert row["low"] < effect < row["high"]
    # width against the normal approximation of the mean's interval: 2 * 1.96 * s / sqrt(n)
    s = float(np.std(noise))  # the bootstrap's plug-in standard deviation (ddof=0)
    assert row["high"] - row["low"] == pytest.approx(2 * 1.959964 * s / math.sqrt(n), rel=0.12)
    null = _only_row(stratify(_pair(base, base + noise), "base", n_resamples=2000))
    assert null["low"] < 0 < null["high"] and null["interval_includes_zero"]


def test_pairing_matters():
    """Large per-example variance shared by both runs: an unpaired bootstrap of the difference of
    means cannot see a +0.2 shift, the paired one can."""
    from scipy import stats

    n = 200
    rng = np.random.default_rng(11)
    base = rng.normal(0.0, 5.0, n)
    run = base + 0.2 + rng.normal(0.0, 0.1, n)
    unpaired = stats.bootstrap((run, base), lambda a, b, axis=-1: a.mean(axis) - b.mean(axis), paired=False,
                               n_resamples=2000, **_rng_kwargs(0))  # scipy < 1.15 has no rng=
    assert unpaired.confidence_interval.low < 0 < unpaired.confidence_interval.high  # the construction works
    row = _only_row(stratify(_pair(base, run), "base"))
    assert row["low"] > 0 and not row["interval_includes_zero"]
    assert row["high"] - row["low"] < 0.1 * (unpaired.confidence_interval.high - unpaired.confidence_interval.low)


def test_rows_are_reproducible_from_the_seed():
    rng = np.random.default_rng(5)
    base, run = rng.random(60), rng.random(60)
    a = _only_row(stratify(_pair(base, run), "base", seed=1, n_resamples=300))
    b = _only_row(stratify(_pair(base, run), "base", seed=1, n_resamples=300))
    c = _only_row(stratify(_pair(base, run), "base", seed=2, n_resamples=300))
    assert (a["low"], a["high"]) == (b["low"], b["high"])
    assert (a["low"], a["high"]) != (c["low"], c["high"])


def test_single_example_has_no_interval():
    row = _only_row(stratify(_pair([0.0], [1.0]), "base"))
    assert (row["n"], row["difference"], row["low"], row["high"]) == (1, 1.0, None, None)
    assert row["interval_includes_zero"] is True


# ---------------------------------------------------------------------------------------------
# strata
# ---------------------------------------------------------------------------------------------


def test_given_length_buckets_match_a_hand_count_and_report_dropped_examples():
    rng = np.random.default_rng(2)
    n = 90
    lengths = rng.integers(5, 300, n)
    base = rng.integers(0, 2, n).astype(float)
    run = rng.integers(0, 2, n).astype(float)
    edges = [0, 50, 120, 300]
    recs = _recs("base", base, lengths=lengths) + _recs("smelt", run[:80], lengths=lengths[:80])
    recs += _recs("smelt", [1.0] * 3, lengths=[7, 60, 200], doc_ids=[1000, 1001, 1002])  # not in the Baseline
    res = stratify(recs, "base", length_buckets=edges, n_resamples=200)
    (c,) = res["comparisons"]
    L = c["length"]
    assert L["edges"] == edges and L["edges_source"] == "given" and L["k"] == 0
    hand_base = [sum(1 for x in lengths if a <= x < b) for a, b in itertools.pairwise(edges)]
    hand_pair = [sum(1 for x in lengths[:80] if a <= x < b) for a, b in itertools.pairwise(edges)]
    assert L["counts"]["base"] == hand_base
    assert L["counts"]["smelt"] == [h + 1 for h in hand_pair]
    assert [r["n"] for r in L["rows"]] == hand_pair
    assert [r["dropped"] for r in L["rows"]] == [{"run_only": 1, "baseline_only": hb - hp}
                                                 for hb, hp in zip(hand_base, hand_pair, strict=True)]
    for i, r in enumerate(L["rows"]):
        sel = [j for j in range(80) if edges[i] <= lengths[j] < edges[i + 1]]
        assert r["difference"] == pytest.approx(float(np.mean(run[sel] - base[sel])), abs=1e-15)
    k0 = c["fewshot"]["rows"][0]
    assert (k0["n"], k0["dropped"]) == (80, {"run_only": 3, "baseline_only": 10})
    assert any("10 example(s) only in 'base' and 3 only in 'smelt'" in note for note in res["notes"])


def test_quantile_buckets_cover_every_example_in_equal_parts():
    n = 4 * MIN_BUCKET_EXAMPLES + 7
    lengths = np.random.default_rng(4).permutation(n) + 3  # distinct lengths 3 .. n+2
    res = stratify(_pair(np.zeros(n), np.ones(n), lengths=lengths), "base", n_resamples=50)
    L = res["comparisons"][0]["length"]
    nb = min(MAX_LENGTH_BUCKETS, n // MIN_BUCKET_EXAMPLES)
    assert L["edges_source"] == "quantiles" and len(L["edges"]) == nb + 1
    assert L["edges"][0] == 3 and L["edges"][-1] == n + 3
    assert sum(L["counts"]["base"]) == n
    assert max(L["counts"]["base"]) - min(L["counts"]["base"]) <= 1
    for r, (a, b) in zip(L["rows"], itertools.pairwise(L["edges"]), strict=True):
        assert r["n"] == sum(1 for x in lengths if a <= x < b)


def test_k_rows_only_for_k_present_and_length_uses_the_smallest_k():
    rng = np.random.default_rng(9)
    recs = []
    for k in (2, 8, 4):
        recs += _pair(rng.random(20), rng.random(20), k=k)
    res = stratify(recs, "base", n_resamples=100)
    (c,) = res["comparisons"]
    assert c["fewshot"]["ks"] == [2, 4, 8]
    assert [r["k"] for r in c["fewshot"]["rows"]] == [2, 4, 8]
    assert c["length"]["k"] == 2 and {r["k"] for r in c["length"]["rows"]} == {2}


def test_baseline_lengths_decide_the_bucket_of_both_copies():
    base = _recs("base", [0.0, 1.0], lengths=[10, 100])
    run = _recs("smelt", [1.0, 1.0], lengths=[100, 10])  # another tokenizer: lengths swapped
    res = stratify(base + run, "base", length_buckets=[0, 50, 200], n_resamples=50)
    rows = res["comparisons"][0]["length"]["rows"]
    assert [(r["n"], r["difference"]) for r in rows] == [(1, 1.0), (1, 0.0)]


# ---------------------------------------------------------------------------------------------
# report, plots, files
# ---------------------------------------------------------------------------------------------


def _mixed_result():
    """acc: k=0 a pure-noise difference, k=1 a clear gain; loss (lower is better): k=0 lower, k=1 higher."""
    rng = np.random.default_rng(1)
    n = 120
    base = rng.integers(0, 2, n).astype(float)
    noise = rng.integers(0, 2, n).astype(float)
    gain = np.where(rng.random(n) < 0.5, 1.0, base)
    lb = rng.normal(3.0, 1.0, n)
    recs = (_pair(base, noise, k=0) + _pair(base, gain, k=1)
            + _pair(lb, lb - 0.5 + rng.normal(0, 0.1, n), metric="loss", k=0)
            + _pair(lb, lb + 0.5 + rng.normal(0, 0.1, n), metric="loss", k=1))
    return stratify(recs, "base", length_buckets=[0, 100], n_resamples=500)


def test_markdown_says_includes_zero_exactly_when_the_interval_does():
    res = _mixed_result()
    md = stratified_markdown(res)
    seen = set()
    for c in res["comparisons"]:
        for r in c["fewshot"]["rows"]:
            start = f"- smelt - base on t {c['metric']} at k={r['k']}:"
            (line,) = [ln for ln in md.splitlines() if ln.startswith(start)]
            assert ("includes 0" in line) == r["interval_includes_zero"], line
            assert f"n={r['n']} examples" in line
            seen.add(r["interval_includes_zero"])
            if not r["interval_includes_zero"]:
                good = (r["difference"] < 0) == (c["metric"] == "loss")
                assert ("smelt is better than base" in line) == good, line
                assert ("smelt is worse than base" in line) == (not good), line
    assert seen == {True, False}  # both kinds of sentence were checked
    acc1 = res["comparisons"][0]["fewshot"]["rows"][1]
    assert f"+{acc1['difference']:.3f} [+{acc1['low']:.3f}, +{acc1['high']:.3f}]" in md


def test_trend_sentence_claims_no_trend_the_intervals_do_not_support():
    rng = np.random.default_rng(6)
    n = 150
    base = rng.normal(0.0, 1.0, n)
    recs = []
    for k in (0, 1, 2):
        noise = rng.normal(0.0, 1.0, n)
        recs += _pair(base, base + noise - noise.mean(), metric="loss", k=k)
    md = stratified_markdown(stratify(recs, "base", n_resamples=300))
    assert "so these data support no trend with k" in md
    assert "do not overlap" not in md


def test_plots_and_files(tmp_path):
    res = _mixed_result()
    paths = plot_stratified(res, tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["stratified_t_acc.png", "stratified_t_loss.png"]
    for p in paths:
        w, h = png_size(p)
        assert w > 100 and h > 100
        assert png_not_blank(p)
    jpath, mpath = write_stratified(res, tmp_path / "report")
    assert json.loads(jpath.read_text())["comparisons"] == json.loads(json.dumps(res["comparisons"]))
    assert mpath.read_text() == stratified_markdown(res)
    leftovers = [p.name for d in (tmp_path / "plots", tmp_path / "report") for p in d.iterdir() if ".tmp" in p.name]
    assert leftovers == []


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def test_errors():
    ok = _pair([0.0, 1.0, 1.0], [1.0, 1.0, 0.0])
    with pytest.raises(ConfigError, match=r"`records` \(\[\]\) is empty"):
        stratify([], "base")
    with pytest.raises(ConfigError, match=r"`baseline` \('baseline'\) is not among the runs .*'base', 'smelt'"):
        stratify(ok, "baseline")
    with pytest.raises(ConfigError, match=r"run 'smelt' has records for task 'code', which the Baseline 'base' lacks"):
        stratify(ok + _recs("smelt", [1.0], task="code"), "base")
    with pytest.raises(ConfigError, match=r"duplicates `records\[1\]`.*\('base', 't', 0, 1, 'acc'\)"):
        stratify(ok + _recs("base", [0.5], doc_ids=[1]), "base")
    with pytest.raises(ConfigError, match=r"`length_buckets` \(\[0, 5\]\) leaves out example doc_id=0"):
        stratify(ok, "base", length_buckets=[0, 5])
    with pytest.raises(ConfigError, match=r"`length_buckets` \(\[10, 5\]\) must be"):
        stratify(ok, "base", length_buckets=[10, 5])
    with pytest.raises(ConfigError, match=r"`records\[0\].value` is missing"):
        stratify([{k: v for k, v in ok[0].items() if k != "value"}], "base")
    with pytest.raises(ConfigError, match=r"`records\[0\].value` \(nan\) is not finite"):
        stratify([{**ok[0], "value": float("nan")}], "base")
    with pytest.raises(ConfigError, match=r"`n_resamples` \(0\)"):
        stratify(ok, "base", n_resamples=0)
    with pytest.raises(ConfigError, match=r"`confidence` \(95\)"):
        stratify(ok, "base", confidence=95)
