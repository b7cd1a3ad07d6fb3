"""Stratified comparisons to the Baseline: a metric by sample-length bucket and by number of
in-context examples k, each as a difference with a paired bootstrap interval over examples.

The SMELT paper's downstream claims are that the gain over the Baseline grows with sample length
and with the number of in-context examples; this module measures both for any runs next to one
Baseline, and says plainly when a difference is not distinguishable from noise.

**Input**: per-example records (one per run, task, k, example and metric), e.g. from
lm-evaluation-harness ``--log_samples`` output::

    {"run": str, "task": str, "num_fewshot": int, "doc_id": int,
     "length_tokens": int,   # the example's own length in tokens, without few-shot examples
     "metric": str,          # "acc" (0/1), "acc_norm", "exact_match" (0/1), "loss" (nats/token), ...
     "value": float}

**Statistics**, for every (task, metric), every run other than the Baseline and every stratum:

- examples are paired by ``doc_id``: only examples present for both the run and the Baseline
  enter; the others are counted (``dropped``) and reported;
- ``difference`` = mean over the ``n`` paired examples of ``value(run) - value(Baseline)`` (pairs
  in ``doc_id`` order), in the metric's unit; for metrics where lower is better (loss, perplexity,
  bits per byte) the difference is still run - Baseline, and ``better`` says ``"lower"``;
- the interval is the paired bootstrap confidence interval of that mean
  (``scipy.stats.bootstrap(..., paired=True)``: one resample of example indices per replicate,
  used for both runs, so the per-example variance the runs share cancels), with
  ``method="BCa"`` (bias-corrected and accelerated; Efron & Tibshirani 1993, *An Introduction to
  the Bootstrap*, ch. 14; scipy's default and second-order accurate, which matters for the skewed
  means of 0/1 metrics), ``n_resamples`` replicates and ``rng`` seeded with ``seed`` afresh for
  every row (rows do not depend on each other or on their order);
- degenerate data: when every paired difference is the same value ``d`` (e.g. two identical runs,
  all differences 0) the bootstrap distribution is a single point and BCa is undefined; the
  interval is then ``[d, d]`` and ``interval`` says ``"constant differences"``. If BCa still
  returns NaN (a degenerate bootstrap distribution on non-constant data, e.g. very few examples)
  the percentile interval of the same replicates is used and ``interval`` says so. With fewer
  than 2 paired examples there is no interval (``low``/``high`` None, ``interval`` ``"none"``);
- ``interval_includes_zero`` = ``low <= 0 <= high``; True also when there is no interval, since
  nothing is distinguishable from noise then.

**Strata**: (a) sample length, on the records of the smallest k present for the Baseline (k=0
when present): bucket ``i`` holds examples with ``edges[i] <= length_tokens < edges[i + 1]``
(tokens; the Baseline's ``length_tokens`` of the example decides, so both runs' copies of an
example fall in the same bucket). Default edges: quantiles of the Baseline's lengths giving
``min(MAX_LENGTH_BUCKETS, n // MIN_BUCKET_EXAMPLES)`` (at least 1) buckets of about equal size
(ties at an edge go up, so sizes can differ); given edges must cover every length.
(b) number of in-context examples k: every k present for the Baseline (0, 1, 2, 4, 8, 16, ...),
all examples of that k.
"""

from __future__ import annotations

import inspect
import itertools
import math
import warnings
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

from smelt_ds.errors import ConfigError
from smelt_ds.eval.plots import DPI, _colors, _plt, safe_name
from smelt_ds.files import write_atomic, write_json_atomic, write_text_atomic

__all__ = ["MIN_BUCKET_EXAMPLES", "MAX_LENGTH_BUCKETS", "POOL_STRIDE", "lower_is_better", "paired_difference",
           "pool_tasks", "stratify", "row_sentence", "stratified_markdown", "plot_stratified", "write_stratified"]

MIN_BUCKET_EXAMPLES = 30
MAX_LENGTH_BUCKETS = 5
METHOD = "BCa"
_FIELDS = {"run": str, "task": str, "num_fewshot": int, "doc_id": int, "length_tokens": int, "metric": str,
           "value": float}
_LOWER_BETTER = {"loss", "nll", "perplexity", "ppl", "word_perplexity", "byte_perplexity", "bits_per_byte",
                 "bpb", "bits_per_token"}


def lower_is_better(metric: str) -> bool:
    """Whether a smaller value of ``metric`` is better: losses (nats/token), perplexities, bits
    per byte; accuracies and exact match are higher-is-better."""
    m = metric.lower()
    return m in _LOWER_BETTER or m.endswith("loss") or "perplexity" in m


# ---------------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------------


#: pooled doc_id = member index * POOL_STRIDE + doc_id (documents of different tasks stay apart)
POOL_STRIDE = 10_000_000


def pool_tasks(records, groups: dict[str, list[str]], metric: str) -> list[dict]:
    """Records of several tasks as one more "task" per group, for a difference pooled over their
    examples (e.g. the code and the prose benchmarks' bits per byte).

    ``groups``: ``{pooled task name: [member task, ...]}``; ``metric``: the one metric pooled
    (it must mean the same in every member, e.g. ``bpb``). Returns new records (the input is
    unchanged): every record of a member task with that metric, with ``task`` = the pooled name and
    ``doc_id`` = ``index of the member in the group * POOL_STRIDE + doc_id``, so pairs are still
    formed within one member's document; every example then weighs the same in the pooled mean
    (a member with more examples weighs more). Raises ConfigError for a doc_id >= POOL_STRIDE or a
    pooled name that is also a task of the records."""
    recs = _check_records(records)
    tasks = {r["task"] for r in recs}
    out = []
    for name, members in groups.items():
        if name in tasks:
            raise ConfigError(f"pooled task name {name!r} is also a task of the records: pick another name")
        index = {t: i for i, t in enumerate(members)}
        for r in recs:
            if r["metric"] != metric or r["task"] not in index:
                continue
            if r["doc_id"] >= POOL_STRIDE:
                raise ConfigError(f"doc_id {r['doc_id']} of task {r['task']!r} is >= {POOL_STRIDE:,}: pooled ids "
                                  "would collide; raise smelt_ds.eval.stratified.POOL_STRIDE above the largest doc_id")
            out.append({**r, "task": name, "doc_id": index[r["task"]] * POOL_STRIDE + r["doc_id"]})
    return out


def _check_records(records) -> list[dict]:
    out = []
    seen: dict[tuple, int] = {}
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ConfigError(f"`records[{i}]` ({r!r}) is not a dict: pass one dict per example with the keys "
                              f"{sorted(_FIELDS)}.")
        rec = {}
        for key, typ in _FIELDS.items():
            if key not in r:
                raise ConfigError(f"`records[{i}].{key}` is missing ({r!r}): every record needs the keys "
                                  f"{sorted(_FIELDS)}.")
            v = r[key]
            if typ is str:
                ok = isinstance(v, str) and v != ""
            elif typ is int:
                ok = isinstance(v, int) and not isinstance(v, bool) or _is_integral(v)
            else:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) or _is_real(v)
            if not ok:
                raise ConfigError(f"`records[{i}].{key}` ({v!r}) is not a {typ.__name__}: write it as a "
                                  f"{'non-empty string' if typ is str else typ.__name__}.")
            rec[key] = typ(v)
        if not math.isfinite(rec["value"]):
            raise ConfigError(f"`records[{i}].value` ({rec['value']!r}) is not finite: drop the record or "
                              "recompute the metric of that example.")
        if rec["num_fewshot"] < 0 or rec["length_tokens"] < 0:
            raise ConfigError(f"`records[{i}]` num_fewshot ({rec['num_fewshot']}) / length_tokens "
                              f"({rec['length_tokens']}) must be >= 0: write the number of in-context examples "
                              "and the example's length in tokens.")
        key5 = (rec["run"], rec["task"], rec["num_fewshot"], rec["doc_id"], rec["metric"])
        if key5 in seen:
            raise ConfigError(f"`records[{i}]` duplicates `records[{seen[key5]}]`: (run, task, num_fewshot, "
                              f"doc_id, metric) = {key5!r} occurs twice: keep one record per example (e.g. the "
                              "harness's per-sample log of one evaluation, not two concatenated).")
        seen[key5] = i
        out.append(rec)
    return out


def _is_integral(v) -> bool:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return False
    return isinstance(v, np.integer)


def _is_real(v) -> bool:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return False
    return isinstance(v, (np.integer, np.floating))


def _check_settings(length_buckets, n_resamples, confidence) -> list[int] | None:
    if not isinstance(n_resamples, int) or isinstance(n_resamples, bool) or n_resamples < 1:
        raise ConfigError(f"`n_resamples` ({n_resamples!r}) must be a positive integer: use e.g. 2000 (more "
                          "replicates give steadier interval ends).")
    if not isinstance(confidence, (int, float)) or not 0.0 < float(confidence) < 1.0:
        raise ConfigError(f"`confidence` ({confidence!r}) must lie strictly between 0 and 1: use e.g. 0.95.")
    if length_buckets is None:
        return None
    edges = list(length_buckets)
    if (len(edges) < 2 or any(not isinstance(e, int) or isinstance(e, bool) for e in edges)
            or any(b <= a for a, b in itertools.pairwise(edges))):
        raise ConfigError(f"`length_buckets` ({length_buckets!r}) must be at least 2 strictly increasing integer "
                          "bucket edges in tokens (bucket i = [edges[i], edges[i+1])): e.g. [0, 64, 128, 100000], "
                          "or None for quantile buckets.")
    return edges


# ---------------------------------------------------------------------------------------------
# bootstrap
# ---------------------------------------------------------------------------------------------


def _rng_kwargs(seed: int) -> dict:
    """``rng=seed`` on scipy >= 1.15 (SPEC-007), ``random_state=np.random.default_rng(seed)`` before."""
    import numpy as np
    from scipy import stats

    if "rng" in inspect.signature(stats.bootstrap).parameters:
        return {"rng": np.random.default_rng(seed)}
    return {"random_state": np.random.default_rng(seed)}


def paired_difference(run_values, baseline_values, n_resamples: int = 2000, seed: int = 0,
                      confidence: float = 0.95) -> dict:
    """Mean of the paired differences ``run_values - baseline_values`` (both ``(n,)``, same order,
    the metric's unit) and its paired bootstrap interval (``scipy.stats.bootstrap``,
    ``paired=True``, BCa; see the module docstring for the degenerate cases).

    Returns ``{"n", "mean_run", "mean_baseline", "difference", "low", "high",
    "interval_includes_zero", "interval"}``.
    """
    import numpy as np
    from scipy import stats

    x = np.asarray(run_values, dtype=np.float64)
    y = np.asarray(baseline_values, dtype=np.float64)
    n = int(x.shape[0])
    if n == 0:
        return {"n": 0, "mean_run": None, "mean_baseline": None, "difference": None, "low": None, "high": None,
                "interval_includes_zero": True, "interval": "none (no paired examples)"}
    diff = x - y
    d = float(np.mean(diff))
    out: dict[str, Any] = {"n": n, "mean_run": float(np.mean(x)), "mean_baseline": float(np.mean(y)),
                           "difference": d}
    if n < 2:
        return {**out, "low": None, "high": None, "interval_includes_zero": True,
                "interval": "none (a bootstrap needs at least 2 paired examples)"}
    if np.allclose(diff, diff[0], rtol=1e-12, atol=1e-12):
        lo = hi = d
        how = "constant differences"
    else:
        def mean_diff(a, b, axis=-1):
            return np.mean(a - b, axis=axis)

        # memory of one batch of resamples (and of BCa's jackknife) ~ batch * n floats
        batch = max(1, min(n_resamples, 2_000_000 // n))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=getattr(stats, "DegenerateDataWarning", RuntimeWarning))
            res = stats.bootstrap((x, y), mean_diff, paired=True, vectorized=True, n_resamples=n_resamples,
                                  batch=batch, confidence_level=confidence, method=METHOD, **_rng_kwargs(seed))
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        how = METHOD
        if not (math.isfinite(lo) and math.isfinite(hi)):
            res = stats.bootstrap((x, y), mean_diff, paired=True, vectorized=True, n_resamples=0,
                                  confidence_level=confidence, method="percentile", bootstrap_result=res,
                                  **_rng_kwargs(seed))
            lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
            how = "percentile (BCa undefined: degenerate bootstrap distribution)"
    return {**out, "low": lo, "high": hi, "interval_includes_zero": bool(lo <= 0.0 <= hi), "interval": how}


# ---------------------------------------------------------------------------------------------
# strata
# ---------------------------------------------------------------------------------------------


def _quantile_edges(lengths: list[int]) -> list[int]:
    import numpy as np

    lo, hi = min(lengths), max(lengths)
    nb = max(1, min(MAX_LENGTH_BUCKETS, len(lengths) // MIN_BUCKET_EXAMPLES))
    qs = np.quantile(np.asarray(lengths), np.linspace(0.0, 1.0, nb + 1)[1:-1], method="inverted_cdf")
    inner = sorted({int(q) for q in qs if lo < int(q) <= hi})
    return [lo, *inner, hi + 1]


def _bucket_of(length: int, edges: list[int]) -> int | None:
    import bisect

    if length < edges[0] or length >= edges[-1]:
        return None
    return bisect.bisect_right(edges, length) - 1


def _split_by_length_bucket(docs: dict, base_len: dict, edges: list[int]) -> list[dict]:
    """``docs`` (doc_id -> record) split into the length buckets of ``edges``; an example's bucket is
    decided by the Baseline's length of it (``base_len``), its own length where the Baseline lacks it."""
    out: list[dict] = [{} for _ in range(len(edges) - 1)]
    for d, r in docs.items():
        b = _bucket_of(base_len.get(d, r["length_tokens"]), edges)
        if b is not None:
            out[b][d] = r
    return out


def _pair(run_docs: dict[int, dict], base_docs: dict[int, dict]) -> tuple[list[int], int, int]:
    common = sorted(set(run_docs) & set(base_docs))
    return common, len(set(run_docs) - set(base_docs)), len(set(base_docs) - set(run_docs))


def _paired_row(run: str, task: str, metric: str, better: str, stratum: str, k: int, run_docs: dict, base_docs: dict,
                n_resamples: int, seed: int, confidence: float, **extra) -> dict:
    common, run_only, base_only = _pair(run_docs, base_docs)
    stats = paired_difference([run_docs[d]["value"] for d in common], [base_docs[d]["value"] for d in common],
                              n_resamples=n_resamples, seed=seed, confidence=confidence)
    return {"run": run, "task": task, "metric": metric, "better": better, "stratum": stratum, "k": k, **extra,
            **stats, "dropped": {"run_only": run_only, "baseline_only": base_only}}


def stratify(records, baseline: str, length_buckets: list[int] | None = None, n_resamples: int = 2000,
             seed: int = 0, confidence: float = 0.95) -> dict:
    """Differences to ``baseline`` by sample-length bucket and by number of in-context examples k,
    with paired bootstrap intervals (see the module docstring for every definition).

    ``records``: per-example dicts (``run``, ``task``, ``num_fewshot``, ``doc_id``,
    ``length_tokens`` (tokens), ``metric``, ``value`` (the metric's unit: 0/1, nats/token, ...)).
    ``length_buckets``: bucket edges in tokens (``[e0, e1, ..., eB]``, bucket i =
    ``[e_i, e_{i+1})``) or None for quantile buckets. ``confidence``: the interval's level.

    Returns ``{"kind": "stratified", "baseline", "runs" (Baseline first), "settings",
    "comparisons": [{"task", "metric", "better", "length": {"k", "edges", "edges_source",
    "labels", "counts": {run: [examples per bucket]}, "rows"}, "fewshot": {"ks", "rows"}}],
    "notes"}``; a row is ``{"run", "task", "metric", "better", "stratum" ("length" | "k"), "k",
    ["bucket", "length_range" [lo, hi)], "n", "mean_run", "mean_baseline", "difference", "low",
    "high", "interval_includes_zero", "interval", "dropped": {"run_only", "baseline_only"}}``.

    Raises ConfigError: no records, ``baseline`` not among the runs, a run with records for a task
    the Baseline lacks, duplicate (run, task, num_fewshot, doc_id, metric) records, malformed
    records or settings, given ``length_buckets`` that leave an example out.
    """
    import scipy

    edges_given = _check_settings(length_buckets, n_resamples, confidence)
    recs = _check_records(records)
    if not recs:
        raise ConfigError("`records` ([]) is empty: pass the per-example records of at least the Baseline and "
                          "one other run (e.g. from lm-eval --log_samples).")
    runs = list(dict.fromkeys(r["run"] for r in recs))
    if baseline not in runs:
        raise ConfigError(f"`baseline` ({baseline!r}) is not among the runs of the records {runs}: pass one of "
                          "those names, or add the Baseline's records.")
    runs = [baseline] + [r for r in runs if r != baseline]
    # data[run][(task, metric)][k][doc_id] = record
    data: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in recs:
        data[r["run"]][(r["task"], r["metric"])][r["num_fewshot"]][r["doc_id"]] = r
    base_tasks = {t for t, _ in data[baseline]}
    for run in runs[1:]:
        for t in sorted({t for t, _ in data[run]} - base_tasks):
            raise ConfigError(f"run {run!r} has records for task {t!r}, which the Baseline {baseline!r} lacks: "
                              f"evaluate {baseline!r} on {t!r} too, or drop {run!r}'s records of {t!r}.")
    notes: list[str] = []
    if len(runs) == 1:
        notes.append(f"only the Baseline {baseline!r} has records: there is nothing to compare.")
    kw: dict[str, Any] = {"n_resamples": n_resamples, "seed": seed, "confidence": float(confidence)}
    comparisons = []
    for task, metric in data[baseline]:
        better = "lower" if lower_is_better(metric) else "higher"
        base = data[baseline][(task, metric)]
        ks = sorted(base)
        k0 = ks[0]
        for run in runs[1:]:
            own = data[run].get((task, metric), {})
            if not own:
                notes.append(f"{task} {metric}: run {run!r} has no records of this metric; no rows for it.")
            for k in sorted(set(own) - set(ks)):
                notes.append(f"{task} {metric}: run {run!r} has k={k} ({len(own[k])} examples) but the Baseline "
                             "does not; those examples are left out.")
        # (a) length buckets at k0: the Baseline's length of an example decides its bucket
        base_len = {d: r["length_tokens"] for d, r in base[k0].items()}
        if edges_given is None:
            edges, source = _quantile_edges(list(base_len.values())), "quantiles"
        else:
            edges, source = edges_given, "given"
            for run in runs:
                for d, r in data[run].get((task, metric), {}).get(k0, {}).items():
                    if _bucket_of(r["length_tokens"], edges) is None:
                        raise ConfigError(
                            f"`length_buckets` ({edges}) leaves out example doc_id={d} of run {run!r} on {task!r} "
                            f"(length_tokens={r['length_tokens']}): bucket i is [edges[i], edges[i+1]); widen the "
                            "first or last edge to cover every length, or pass None for quantile buckets.")
        nb = len(edges) - 1
        base_b = _split_by_length_bucket(base[k0], base_len, edges)
        counts = {baseline: [len(b) for b in base_b]}
        lrows, krows = [], []
        for run in runs[1:]:
            own = data[run].get((task, metric), {})
            if not own:
                continue
            run_b = _split_by_length_bucket(own.get(k0, {}), base_len, edges)
            counts[run] = [len(b) for b in run_b]
            for i in range(nb):
                lrows.append(_paired_row(run, task, metric, better, "length", k0, run_b[i], base_b[i], bucket=i,
                                         length_range=[edges[i], edges[i + 1]], **kw))
            # (b) every k the Baseline has
            for k in ks:
                krows.append(_paired_row(run, task, metric, better, "k", k, own.get(k, {}), base[k], **kw))
        comparisons.append({"task": task, "metric": metric, "better": better,
                            "length": {"k": k0, "edges": edges, "edges_source": source,
                                       "labels": [f"{a}-{b - 1}" for a, b in itertools.pairwise(edges)],
                                       "counts": counts, "rows": lrows},
                            "fewshot": {"ks": ks, "rows": krows}})
        dropped = [(r["run"], r["stratum"], r["k"], r["dropped"]) for r in lrows + krows
                   if r["dropped"]["run_only"] or r["dropped"]["baseline_only"]]
        for run, stratum, k, dr in dropped:
            if stratum == "k":
                notes.append(f"{task} {metric} k={k}: {dr['baseline_only']} example(s) only in {baseline!r} and "
                             f"{dr['run_only']} only in {run!r} are left out of the pairing.")
    settings = {"n_resamples": n_resamples, "seed": seed, "confidence": float(confidence), "method": METHOD,
                "statistic": "mean over paired examples of value(run) - value(Baseline)",
                "resampling": "scipy.stats.bootstrap(paired=True): examples paired by doc_id, resampled jointly",
                "rng": f"numpy.random.default_rng({seed}) afresh per row",
                "length_buckets": edges_given, "min_bucket_examples": MIN_BUCKET_EXAMPLES,
                "max_length_buckets": MAX_LENGTH_BUCKETS, "scipy": scipy.__version__}
    return {"kind": "stratified", "baseline": baseline, "runs": runs, "settings": settings,
            "comparisons": comparisons, "notes": notes}


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def _difference_text(x: float | None, sign: bool = True) -> str:
    if x is None:
        return "—"
    if x == 0.0:
        return "+0.000" if sign else "0.000"
    s = f"{x:+.3f}" if abs(x) >= 0.0005 else f"{x:+.2e}"
    if not sign:
        s = s.lstrip("+")
    return s.replace("-", "−")


def _stratum_text(row: dict) -> str:
    if row["stratum"] == "k":
        return f"at k={row['k']}"
    lo, hi = row["length_range"]
    return f"at length {lo}-{hi - 1} tokens (k={row['k']})"


def row_sentence(row: dict, baseline: str, confidence: float = 0.95) -> str:
    """The plain sentence of one comparison row, e.g. ``smelt - baseline on lambada acc at k=4:
    +0.031 [−0.012, +0.074]: the 95% interval includes 0, so this difference is not
    distinguishable from noise at n=200 examples.``"""
    pct = f"{confidence:.0%}"
    head = f"{row['run']} - {baseline} on {row['task']} {row['metric']} {_stratum_text(row)}"
    n = row["n"]
    if n == 0:
        return (f"{head}: no paired examples (no interval, so it counts as an interval that includes 0: nothing "
                "to distinguish from noise).")
    d = _difference_text(row["difference"])
    if row["low"] is None:
        return (f"{head}: {d} from n={n} example; no bootstrap interval (it needs at least 2 paired examples), so "
                "it counts as an interval that includes 0: not distinguishable from noise.")
    ci = f"{d} [{_difference_text(row['low'])}, {_difference_text(row['high'])}]"
    const = ""
    if row["interval"] == "constant differences":
        const = (f" (every one of the n={n} paired differences equals {d}, so the bootstrap interval is the "
                 "single point [d, d])")
    if row["interval_includes_zero"]:
        return (f"{head}: {ci}{const}: the {pct} interval includes 0, so this difference is not distinguishable "
                f"from noise at n={n} examples.")
    good = (row["difference"] < 0) == (row["better"] == "lower")
    verdict = "better" if good else "worse"
    return (f"{head}: {ci}{const}: the {pct} interval excludes 0: {row['run']} is {verdict} than {baseline} here "
            f"({row['better']} {row['metric']} is better), at n={n} examples.")


def _trend(rows: list[dict], what: str, baseline: str) -> str | None:
    """What the intervals of one run across a stratum do and do not support."""
    with_ci = [r for r in rows if r["low"] is not None]
    if len(with_ci) < 2:
        return None
    run = rows[0]["run"]
    excl = [r for r in with_ci if not r["interval_includes_zero"]]
    lab = (lambda r: f"k={r['k']}") if what == "k" else (lambda r: f"{r['length_range'][0]}-{r['length_range'][1] - 1}")
    if not excl:
        return (f"{run}: no {what} stratum shows a difference to {baseline} distinguishable from noise, so these "
                f"data support no trend with {what}.")
    first, last = with_ci[0], with_ci[-1]
    s = f"{run}: the interval excludes 0 at {', '.join(lab(r) for r in excl)} only" if len(excl) < len(with_ci) \
        else f"{run}: the interval excludes 0 at every {what} stratum"
    if first["high"] >= last["low"] and last["high"] >= first["low"]:
        return (s + f"; the intervals at {lab(first)} and {lab(last)} overlap, so the data do not establish that "
                f"the difference changes with {what}.")
    direction = "larger" if last["difference"] > first["difference"] else "smaller"
    return (s + f"; the intervals at {lab(first)} and {lab(last)} do not overlap: the difference is {direction} at "
            f"{lab(last)} ({_difference_text(last['difference'])} vs {_difference_text(first['difference'])}).")


def _table(rows: list[dict], baseline: str, label) -> list[str]:
    out = [f"| {label[0]} | run | n | {baseline} mean | run mean | Δ | interval | includes 0 | dropped (run / base) |",
           "|---|---|---:|---:|---:|---:|---|---|---:|"]
    for r in rows:
        ci = "—" if r["low"] is None else f"[{_difference_text(r['low'])}, {_difference_text(r['high'])}]"
        if r["interval"] not in (METHOD, "constant differences") and r["low"] is not None:
            ci += " (percentile)"
        if r["interval"] == "constant differences":
            ci += " (constant)"
        out.append(f"| {label[1](r)} | {r['run']} | {r['n']} | {_difference_text(r['mean_baseline'], False)} | "
                   f"{_difference_text(r['mean_run'], False)} | {_difference_text(r['difference'])} | {ci} | "
                   f"{'yes' if r['interval_includes_zero'] else 'no'} | "
                   f"{r['dropped']['run_only']} / {r['dropped']['baseline_only']} |")
    return out


def stratified_markdown(result: dict) -> str:
    """The report of :func:`stratify`: per task and metric a table by length bucket and one by k,
    a plain sentence per row, and what the intervals do (not) support about a trend."""
    b, st = result["baseline"], result["settings"]
    pct = f"{st['confidence']:.0%}"
    md = [f"# Stratified comparisons vs the Baseline {b}", "",
          f"Runs: {', '.join(result['runs'])}. Δ = run − {b}, the mean over examples present in both runs (paired "
          f"by doc_id) of the per-example difference, in the metric's unit. Interval: {pct} paired bootstrap "
          f"over examples (scipy.stats.bootstrap, paired=True, method={st['method']}, {st['n_resamples']} "
          f"resamples, seed {st['seed']}; scipy {st['scipy']}). Where every paired difference is the same value d "
          "the interval is [d, d] (marked 'constant'). For loss-like metrics lower is better; Δ is still "
          "run − Baseline, so a negative Δ is an improvement there. Means here are plain means of per-example "
          "values (e.g. each example's bits per byte), not the harness's aggregates (which pool bytes or "
          "tokens over examples), so they can differ from the harness's table.", ""]
    for c in result["comparisons"]:
        L, K = c["length"], c["fewshot"]
        md += [f"## {c['task']} — {c['metric']} ({c['better']} is better)", ""]
        md += [f"### By sample length (k={L['k']}; bucket edges in tokens {L['edges']} from {L['edges_source']}, "
               "bucket i = [edges[i], edges[i+1]); labels lo-hi are inclusive; the example's own tokens, without "
               "few-shot examples)", ""]
        md.append("Examples per bucket: " + "; ".join(f"{run}: {cnt}" for run, cnt in L["counts"].items()))
        md.append("")
        if L["rows"]:
            md += _table(L["rows"], b, ("length (tokens)", lambda r: f"{r['length_range'][0]}-"
                                                                    f"{r['length_range'][1] - 1}"))
            md.append("")
            md += [f"- {row_sentence(r, b, st['confidence'])}" for r in L["rows"]]
            for run in result["runs"][1:]:
                t = _trend([r for r in L["rows"] if r["run"] == run], "length", b)
                if t:
                    md.append(f"- Trend: {t}")
        md += ["", f"### By number of in-context examples k (k present: {K['ks']})", ""]
        if K["rows"]:
            md += _table(K["rows"], b, ("k", lambda r: str(r["k"])))
            md.append("")
            md += [f"- {row_sentence(r, b, st['confidence'])}" for r in K["rows"]]
            for run in result["runs"][1:]:
                t = _trend([r for r in K["rows"] if r["run"] == run], "k", b)
                if t:
                    md.append(f"- Trend: {t}")
        md.append("")
    if result["notes"]:
        md += ["## Notes", ""] + [f"- {n}" for n in result["notes"]] + [""]
    return "\n".join(md)


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------


def _panel(ax, rows: list[dict], runs: list[str], colors: list, xlabels: list[str], key) -> None:
    ax.axhline(0.0, color="grey", lw=0.8)
    others = runs[1:]
    width = 0.3 / max(1, len(others))
    for j, run in enumerate(others):
        rr = [r for r in rows if r["run"] == run and r["difference"] is not None]
        if not rr:
            continue
        xs = [key(r) + (j - (len(others) - 1) / 2) * width for r in rr]
        ys = [r["difference"] for r in rr]
        lo = [0.0 if r["low"] is None else r["difference"] - r["low"] for r in rr]
        hi = [0.0 if r["high"] is None else r["high"] - r["difference"] for r in rr]
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", color=colors[j + 1], ms=4, capsize=3, lw=1.2, label=run)
    ax.set_xticks(range(len(xlabels)), xlabels, fontsize=7, rotation=30 if len(xlabels) > 4 else 0)
    ax.set_xlim(-0.5, max(0.5, len(xlabels) - 0.5))


def plot_stratified(result: dict, out_dir) -> list[Path]:
    """One PNG per (task, metric), ``stratified_<task>_<metric>.png``: the difference to the
    Baseline (the metric's unit) vs sample-length bucket (tokens) and vs k, one line per
    non-Baseline run with its interval as error bars, and a zero line. Written atomically
    (temporary file + ``os.replace``). Returns the paths written."""
    plt = _plt()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs, b = result["runs"], result["baseline"]
    colors = _colors(len(runs))
    pct = f"{result['settings']['confidence']:.0%}"
    paths: list[Path] = []
    for c in result["comparisons"]:
        L, K = c["length"], c["fewshot"]
        fig, axes = plt.subplots(1, 2, figsize=(8.0, 3.2), layout="constrained", sharey=True)
        _panel(axes[0], L["rows"], runs, colors, L["labels"], lambda r: r["bucket"])
        kpos = {k: i for i, k in enumerate(K["ks"])}
        _panel(axes[1], K["rows"], runs, colors, [str(k) for k in K["ks"]], lambda r, kpos=kpos: kpos[r["k"]])
        axes[0].set_xlabel(f"sample length (tokens), k={L['k']}")
        axes[1].set_xlabel("in-context examples k")
        axes[0].set_ylabel(f"Δ {c['metric']} vs {b}\n({c['better']} is better)", fontsize=8)
        if len(runs) > 1:
            axes[0].legend(fontsize=7, title=f"{pct} paired bootstrap", title_fontsize=7)
        fig.suptitle(f"{c['task']}: {c['metric']}, run − {b}", fontsize=10)
        name = f"stratified_{safe_name(c['task'])}_{safe_name(c['metric'])}.png"
        path = out_dir / name
        i = 2
        while path in paths:
            path = out_dir / name.replace(".png", f"_{i}.png")
            i += 1
        try:
            write_atomic(path, partial(fig.savefig, dpi=DPI, format="png"))
        finally:
            plt.close(fig)
        paths.append(path)
    return paths


def write_stratified(result: dict, out_dir, stem: str = "stratified") -> tuple[Path, Path]:
    """Write ``<stem>.json`` (the whole result; non-finite floats as null) and ``<stem>.md``
    (:func:`stratified_markdown`) in ``out_dir``, each atomically. Returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    write_json_atomic(jpath, result)
    write_text_atomic(mpath, stratified_markdown(result))
    return jpath, mpath
