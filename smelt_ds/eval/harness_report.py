"""What the harness gave, per example and per task: the examples' own lengths and which ones a
context truncated (:func:`own_lengths`, :func:`truncated_examples`), the per-example records
(:func:`harness_records`), the metric table of lm-eval's results (:func:`metric_table`) and the
report ``smelt-ds eval --harness`` writes (:func:`harness_report`, :func:`harness_markdown`).
The model and the harness runs are :mod:`smelt_ds.eval.harness`."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from smelt_ds.errors import ConfigError
from smelt_ds.eval.benchmarks import downloads_named
from smelt_ds.eval.harness import SmeltHarnessLM, check_tasks, sorted_samples, task_manager

__all__ = ["own_lengths", "spread_samples", "request_tokens", "truncated_examples", "harness_records",
           "metric_table", "harness_report", "harness_markdown"]

# ---------------------------------------------------------------------------------------------
# per-example records and the metric table
# ---------------------------------------------------------------------------------------------


def own_lengths(lm: SmeltHarnessLM, tasks: list[str], include_path: str | None = None,
                limit: int | None = None, samples: dict[str, list[int]] | None = None) -> dict[tuple[str, int], int]:
    """``{(task, doc_id): tokens}``: the length of each example's own text at k = 0, built by the
    harness itself (``Task.build_all_requests`` with ``num_fewshot`` 0, no model call):
    context + target for ``loglikelihood`` tasks, the context for ``multiple_choice`` and
    ``generate_until``, the whole string for ``loglikelihood_rolling`` (tokens of
    :meth:`SmeltHarnessLM.tok_encode`). ``limit`` / ``samples``: the documents, as :func:`run_harness`."""
    tm = task_manager(check_tasks(tasks), include_path)
    with downloads_named(check_tasks(tasks)):
        loaded = tm.load(check_tasks(tasks))
    samples = sorted_samples(samples)
    out: dict[tuple[str, int], int] = {}
    for name, task in loaded["tasks"].items():
        task.set_config(key="num_fewshot", value=0)
        chosen = None if samples is None else samples.get(name)
        task.build_all_requests(limit=limit, samples=chosen, rank=0, world_size=1)
        first: dict[int, Any] = {}
        for inst in task.instances:
            if inst.doc_id not in first or inst.idx < first[inst.doc_id].idx:
                first[inst.doc_id] = inst
        for doc_id, inst in first.items():
            if chosen:  # lm-eval numbers the chosen documents 0..n-1 here and logs their own index
                doc_id = chosen[doc_id]
            if inst.request_type == "loglikelihood" and task.OUTPUT_TYPE == "loglikelihood":
                text = inst.args[0] + inst.args[1]
            else:
                text = inst.args[0]
            out[(name, int(doc_id))] = len(lm.tok_encode(text))
    return out


def spread_samples(tasks: list[str], n: int, include_path: str | None = None) -> dict[str, list[int]]:
    """``{task: [doc index, ...]}``: ``n`` documents of each task spread evenly over its evaluation
    documents (indices ``round(i * (D - 1) / (n - 1))``, i = 0..n-1, for D documents; all D when
    ``n >= D``), for :func:`run_harness`'s ``samples``. Unlike ``limit`` (the first ``n``), this
    does not take only the head of a file that is sorted (HellaSwag's validation starts with its
    short ActivityNet contexts). Groups expand to their tasks. Raises ConfigError for ``n < 1``."""
    if n < 1:
        raise ConfigError(f"`--samples-per-task` ({n}) must be >= 1 documents per task")
    names = check_tasks(tasks)
    loaded = task_manager(names, include_path).load(names)
    out = {}
    for name, task in loaded["tasks"].items():
        total = len(task.eval_docs)
        if n >= total:
            out[name] = list(range(total))
        else:  # n < total: steps of (total - 1) / (n - 1) >= 1 give n distinct indices
            out[name] = [0] if n == 1 else [round(i * (total - 1) / (n - 1)) for i in range(n)]
    return out


def request_tokens(lm: SmeltHarnessLM, results: dict) -> dict[tuple[str, int], int]:
    """``{(task, doc_id): tokens}``: the longest ``loglikelihood`` request of each example of a
    ``log_samples`` result as the model reads it (``[end-of-text] + context + continuation``,
    :meth:`SmeltHarnessLM._encode_pair`), few-shot examples included. A request longer than
    ``lm.max_length + 1`` tokens has its context cut from the left (:meth:`SmeltHarnessLM._window`),
    so a k-shot example over that length was not scored with its k examples whole
    (:func:`truncated_examples`). Examples of other request types are absent."""
    if "samples" not in results:
        raise ConfigError("the harness result has no per-example samples: evaluate with log_samples=True")
    out: dict[tuple[str, int], int] = {}
    for task, samples in results["samples"].items():
        for s in samples:
            pairs = [a for a in s.get("arguments", []) if isinstance(a, (list, tuple)) and len(a) == 2
                     and all(isinstance(x, str) for x in a)]
            if pairs:
                out[(task, int(s["doc_id"]))] = max(sum(map(len, lm._encode_pair(c, x))) for c, x in pairs)
    return out


def truncated_examples(lm: SmeltHarnessLM, results: dict) -> tuple[set[tuple[str, int]], dict[str, dict[str, int]]]:
    """The examples of a ``log_samples`` result whose longest request exceeds the model's window
    (``lm.max_length + 1`` tokens: :func:`request_tokens`), and per task ``{"examples", "truncated",
    "max_tokens"}`` (examples with a ``loglikelihood`` request, how many of them exceed the window,
    the longest request in tokens)."""
    tokens = request_tokens(lm, results)
    over = {key for key, n in tokens.items() if n > lm.max_length + 1}
    per: dict[str, dict[str, int]] = {}
    for (task, _), n in tokens.items():
        c = per.setdefault(task, {"examples": 0, "truncated": 0, "max_tokens": 0})
        c["examples"] += 1
        c["truncated"] += n > lm.max_length + 1
        c["max_tokens"] = max(c["max_tokens"], n)
    return over, per


def harness_records(results: dict, run_name: str, num_fewshot: int | None,
                    lengths: dict[tuple[str, int], int], skip: set[tuple[str, int]] | frozenset = frozenset()
                    ) -> list[dict]:
    """Per-example records for :func:`smelt_ds.eval.stratified.stratify` from a ``log_samples``
    result: ``{"run", "task", "num_fewshot", "doc_id", "length_tokens", "metric", "value"}``.

    Metrics: every per-example scalar the task reports (``acc``, ``acc_norm``, ``exact_match``,
    ...; named ``metric,filter`` for a filter other than ``none``, as in :func:`metric_table`),
    except ``perplexity`` of ``loglikelihood`` tasks, whose per-example value is a
    log-likelihood: it becomes ``nll`` (nats over the target, lower is better). Rolling tasks'
    ``(log-likelihood, words|bytes)`` pairs become ``loss`` = -ll / length_tokens (nats/token)
    and ``bits_per_byte`` = -ll / (bytes * ln 2). ``length_tokens`` comes from ``lengths``
    (:func:`own_lengths`); ``num_fewshot`` is the k that ran (the result's ``n-shot``), the
    requested one only where the result lacks it; a loglikelihood task with a ``bits_per_byte`` pair
    (``smelt_humaneval_ll``) gives ``bits_per_byte`` only; ``num_fewshot`` None takes each task's k
    from the result's ``n-shot``. ``skip``: ``(task, doc_id)`` left out (e.g. the truncated ones of
    :func:`truncated_examples`). Raises ConfigError without samples."""
    if "samples" not in results:
        raise ConfigError("the harness result has no per-example samples: evaluate with log_samples=True")
    out = []
    for task, samples in results["samples"].items():
        for s in samples:
            doc_id = int(s["doc_id"])
            if (task, doc_id) in skip:
                continue
            if (task, doc_id) not in lengths:
                raise ConfigError(f"no length for example {doc_id} of task {task!r}: compute `lengths` with "
                                  "own_lengths() for the same tasks and limit")
            n = lengths[(task, doc_id)]
            # the k that ran: a task whose YAML fixes num_fewshot 0 (rolling) ignores the requested k
            k = results.get("n-shot", {}).get(task, 0 if num_fewshot is None else num_fewshot)
            base = {"run": run_name, "task": task, "num_fewshot": int(k), "doc_id": doc_id,
                    "length_tokens": n}
            for metric, value in _example_values(s, n):
                out.append({**base, "metric": _metric_name(metric, s.get("filter")), "value": value})
    return out


def _example_values(sample: dict, length_tokens: int) -> Iterator[tuple[str, float]]:
    pairs = {}
    for m in sample.get("metrics", []):
        v = sample.get(m)
        if isinstance(v, (list, tuple)) and len(v) == 2:
            pairs[m] = v
        elif isinstance(v, (bool, int, float)):
            yield ("nll", -float(v)) if m == "perplexity" else (m, float(v))
    if pairs:
        ll = float(next(iter(pairs.values()))[0])
        if length_tokens > 0 and {"word_perplexity", "byte_perplexity"} & set(pairs):  # rolling: whole text scored
            yield "loss", -ll / length_tokens
        if "bits_per_byte" in pairs and pairs["bits_per_byte"][1]:
            yield "bits_per_byte", -ll / (float(pairs["bits_per_byte"][1]) * math.log(2))


def metric_table(results: dict) -> dict[str, dict[str, dict[str, float | None]]]:
    """``{task or group: {metric: {"value", "stderr"}}}`` from the harness's ``results`` and
    ``groups`` sections. Keys ``metric,filter`` become ``metric`` for the filter ``none`` and stay
    ``metric,filter`` for a task's named filters (e.g. ``exact_match,strip``); a stderr the
    harness reports as ``N/A`` is None."""
    out: dict[str, dict[str, dict[str, float | None]]] = defaultdict(dict)
    for section in ("results", "groups"):
        for task, metrics in results.get(section, {}).items():
            for key, value in metrics.items():
                if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                metric, filt = key.split(",", 1)
                if metric.endswith("_stderr"):
                    continue
                err = metrics.get(f"{metric}_stderr,{filt}")
                out[task][_metric_name(metric, filt)] = {
                    "value": float(value), "stderr": float(err) if isinstance(err, (int, float)) else None}
    return dict(out)


def _metric_name(metric: str, filt: str | None) -> str:
    return metric if filt in (None, "none") else f"{metric},{filt}"


def harness_report(entries: list[dict]) -> dict:
    """Our comparison of harness results: one column per (run, test-time loop plan), one row per
    (k, task or group, metric), the first column being the Baseline.

    ``entries``: ``[{"column", "run", "label", "repeats", "exit_after", "visits", "flops_per_token"
    (forward FLOPs per token of the plan run), "kv_cache_bytes_per_token", "num_fewshot" (k asked,
    None = the tasks' own), "results" (a :func:`run_harness` result), "results_file"}]``.
    Returns ``{"kind": "harness", "baseline", "columns": [{"name", "run", "label", "repeats",
    "exit_after", "visits", "flops_per_token", "kv_cache_bytes_per_token"}], "files": {column: {k: path}},
    "table": [{"num_fewshot", "task", "metric", "values": {column: value}, "stderr": {column: stderr | None},
    "delta": {column: value - Baseline value}}]}``; values in the metric's unit (accuracy 0-1, perplexity, bits/byte).
    """
    if not entries:
        raise ConfigError("no harness results to report: evaluate at least one run")
    columns: dict[str, dict] = {}
    files: dict[str, dict[str, str]] = defaultdict(dict)
    cells: dict[tuple[str, str, str], dict[str, dict]] = {}
    for e in entries:
        keys = ("run", "label", "repeats", "exit_after", "visits", "flops_per_token", "kv_cache_bytes_per_token")
        columns.setdefault(e["column"], {k: e.get(k) for k in keys} | {"name": e["column"]})
        k_label = "task default" if e["num_fewshot"] is None else str(e["num_fewshot"])
        files[e["column"]][k_label] = str(e.get("results_file", ""))
        for task, metrics in metric_table(e["results"]).items():
            for metric, cell in metrics.items():
                cells.setdefault((k_label, task, metric), {})[e["column"]] = cell
    names = list(columns)
    base = names[0]
    table = []
    for (k_label, task, metric), per in cells.items():
        values = {c: per[c]["value"] if c in per else None for c in names}
        b = values[base]
        table.append({"num_fewshot": k_label, "task": task, "metric": metric, "values": values,
                      "stderr": {c: per[c]["stderr"] if c in per else None for c in names},
                      "delta": {c: None if v is None or b is None else v - b for c, v in values.items() if c != base}})
    return {"kind": "harness", "baseline": base, "columns": list(columns.values()), "files": dict(files),
            "table": table}


def _cell(v: float | None, err: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.4f}" + ("" if err is None or not math.isfinite(err) else f" ± {err:.4f}")


def harness_markdown(report: dict) -> str:
    """:func:`harness_report` as Markdown: value ± stderr per column, Δ = column - Baseline."""
    names = [c["name"] for c in report["columns"]]
    base, others = report["baseline"], names[1:]
    lines = [f"# smelt-ds harness: {' vs '.join(names)}", ""]
    for c in report["columns"]:
        cost = ""
        if c.get("flops_per_token") is not None:
            cost = (f", {c['flops_per_token']:,.0f} forward FLOPs/token, {c['kv_cache_bytes_per_token']:,.0f} KV-cache "
                    "bytes/token")
        lines.append(f"- **{c['name']}**: run {c['run']}, {c['visits']} visits" + cost
                     + (f", {c['label']}" if c.get("label") else ""))
    lines += ["", f"Value ± the harness's standard error; Δ = column minus {base} (the first run). The harness "
              "bootstraps the stderr of perplexity-type metrics (heavy-tailed: read it as rough), and reports "
              "none for bits_per_byte (byte-weighted, of whole texts); bpb (the benchmark tasks' gold bits per "
              "byte) is a mean over documents, with the standard error of a mean. k is the requested number of "
              "in-context examples; a task whose YAML fixes k = 0 (the rolling one) runs the same at every k.", ""]
    head = ["task", "metric", "k"] + names + [f"Δ {n}" for n in others]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report["table"]:
        vals = [_cell(row["values"][n], row["stderr"][n]) for n in names]
        deltas = ["n/a" if row["delta"][n] is None else f"{row['delta'][n]:+.4f}" for n in others]
        lines.append("| " + " | ".join([row["task"], row["metric"], row["num_fewshot"]] + vals + deltas) + " |")
    lines.append("")
    lines += _truncation_markdown(report.get("truncation") or {}, names)
    return "\n".join(lines)


def _truncation_markdown(truncation: dict[str, dict[str, dict]], names: list[str]) -> list[str]:
    """Rows (task, k) where some example's request exceeded the model's window, per column."""
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for col, by_k in truncation.items():
        for k, per_task in by_k.items():
            for task, c in per_task.items():
                rows.setdefault((task, k), {})[col] = c
    hit = {key: cols for key, cols in rows.items() if any(c["truncated"] for c in cols.values())}
    if not hit:
        return []
    lines = ["Examples whose longest request (end-of-text + k examples + context + answer) exceeds the model's "
             "window, so that its context was cut from the left: truncated / examples (longest request in "
             "tokens; loglikelihood requests only). The means above include them as the harness scored them; "
             "the stratified report leaves them out.", "",
             "| task | k | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 2)]
    for (task, k), cols in sorted(hit.items(), key=lambda kv: (kv[0][0], int(kv[0][1]) if kv[0][1].isdigit() else -1)):
        cells = [f"{cols[n]['truncated']} / {cols[n]['examples']} ({cols[n]['max_tokens']})" if n in cols else "n/a"
                 for n in names]
        lines.append(f"| {task} | {k} | " + " | ".join(cells) + " |")
    return lines + [""]
