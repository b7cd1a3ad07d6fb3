"""Comparison tables: one column per run and the difference of every other run to the first
(the Baseline), as rows of plain values (JSON) and as Markdown.

A table row is ``{"section", "metric", "unit", "values": {run: float | None}, "delta": {run: float | None}}``
with ``delta[run] = values[run] - values[first]`` (absent values give None).
"""

from __future__ import annotations

import math
from pathlib import Path

from smelt_ds.files import write_json_atomic, write_text_atomic

__all__ = ["eval_table", "analysis_table", "to_markdown", "details_markdown", "write_report"]


def _table_row(section: str, metric: str, unit: str, values: dict, names: list[str]) -> dict:
    ref = values.get(names[0])
    delta = {}
    for n in names[1:]:
        v = values.get(n)
        delta[n] = None if v is None or ref is None else v - ref
    return {"section": section, "metric": metric, "unit": unit, "values": {n: values.get(n) for n in names},
            "delta": delta}


def _finite(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _domain_label(domain: str) -> str:
    """``all`` is the mean of the domains' values, each domain weighted equally (as training's
    ``val/all``; :data:`smelt_ds.runs.validation_loss.ALL_DEFINITION`): the label says so."""
    return "all (domains weighted equally)" if domain == "all" else domain


def eval_table(result: dict) -> list[dict]:
    """Rows of ``smelt-ds eval``: per-domain loss and bits per byte (and ``all``, domains weighted
    equally), loss by position bucket (domains weighted equally), and in-context loss (and
    accuracy) per task and k."""
    names = [r["name"] for r in result["runs"]]
    rows = []
    domains = list(dict.fromkeys(d for n in names for d in result["domains"][n]))
    for d in domains:
        rows.append(_table_row("validation", f"loss {_domain_label(d)}", "nats/token",
                               {n: _finite(result["domains"][n].get(d, {}).get("loss")) for n in names}, names))
    for d in domains:
        rows.append(_table_row("validation", f"bits per byte {_domain_label(d)}", "bits/byte",
                               {n: _finite(result["domains"][n].get(d, {}).get("bits_per_byte")) for n in names},
                               names))
    for i, (s, e) in enumerate(result["settings"]["buckets"]):
        vals = {}
        for n in names:
            pos = result["domains"][n].get("all", {}).get("positions", [])
            vals[n] = _finite(pos[i]["loss"]) if i < len(pos) else None
        rows.append(_table_row("loss by position (domains weighted equally)", f"positions {s}-{e}", "nats/token", vals,
                               names))
    for task, info in result["tasks"].items():
        shots = list(dict.fromkeys(k for n in names for k in result["icl"][n].get(task, {})))
        for k in shots:
            vals = {n: (result["icl"][n].get(task, {}).get(k) or {}).get("loss") for n in names}
            rows.append(_table_row(f"in-context: {task}", f"k={k} loss", "nats/token", vals, names))
        if info["kind"] == "synthetic" or task == "word_case":
            for k in shots:
                vals = {n: (result["icl"][n].get(task, {}).get(k) or {}).get("accuracy") for n in names}
                rows.append(_table_row(f"in-context: {task}", f"k={k} accuracy", "share", vals, names))
    return rows


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def analysis_table(result: dict) -> list[dict]:
    """Rows of ``smelt-ds analyze`` comparable across runs with equal visit counts: head-mean
    attention statistics per depth, first vs second visits of looped layers, routing summaries,
    logit-lens loss per depth and at loop boundaries."""
    names = [r["name"] for r in result["runs"]]
    A = result["analysis"]
    rows = []
    for stat, label, unit in (("first_mass", "first-token mass", "share"), ("content_mass", "content mass", "share"),
                              ("entropy", "attention entropy", "nats")):
        rows.append(_table_row("attention (mean over visits and heads)", label, unit,
                               {n: _mean([v["mean"][stat] for v in A[n]["attention"].values()]) for n in names}, names))
    for stat, label in (("first_mass", "first-token mass"), ("content_mass", "content mass")):
        for which, idx in (("first", 0), ("last", -1)):
            vals = {n: _mean([c[stat][idx] for c in A[n]["attention_visits"]]) for n in names}
            rows.append(_table_row("attention of looped layers", f"{label}, {which} visit", "share", vals, names))
    max_depth = max(len(A[n]["logit_lens"]["depths"]) for n in names)
    for d in range(1, max_depth):
        vals = {}
        for n in names:
            key = [k for k, v in A[n]["attention"].items() if v["plan_index"] == d - 1]
            vals[n] = A[n]["attention"][key[0]]["mean"]["first_mass"] if key else None
        rows.append(_table_row("first-token mass by depth", f"depth {d}", "share", vals, names))
    rows.append(_table_row("routing", "load max/mean (mean over MoE visits)", "ratio",
                           {n: _mean([v["load_max_over_mean"] for v in A[n]["routing"]["visits"].values()])
                            for n in names},
                           names))
    rows.append(_table_row("routing", "divergence between visits (mean over looped layers)", "share of tokens",
                           {n: _mean([x["divergence"] for x in A[n]["routing"]["divergence"]]) for n in names}, names))
    rows.append(_table_row("routing", "experts kept between visits (mean)", "share",
                           {n: _mean([x["overlap"] for x in A[n]["routing"]["divergence"]]) for n in names}, names))
    for d in range(max_depth):
        vals = {}
        for n in names:
            rows_n = A[n]["logit_lens"]["depths"]
            vals[n] = rows_n[d]["loss"] if d < len(rows_n) else None
        rows.append(_table_row("logit lens", "embedding" if d == 0 else f"after visit {d}", "nats/token", vals, names))
    return rows


def _value_text(x, unit: str) -> str:
    if x is None:
        return "–"
    return f"{x:.3f}" if unit in ("share", "share of tokens") else f"{x:.4f}"


def _delta_text(x, unit: str) -> str:
    if x is None:
        return "–"
    return f"{x:+.3f}" if unit in ("share", "share of tokens") else f"{x:+.4f}"


def to_markdown(rows: list[dict], names: list[str]) -> str:
    """A Markdown table: metric, unit, one column per run, ``Δ <run>`` per non-first run."""
    head = ["metric", "unit", *names, *[f"Δ {n}" for n in names[1:]]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    section = None
    for r in rows:
        if r["section"] != section:
            section = r["section"]
            lines.append(f"| **{section}** |" + " |" * (len(head) - 1))
        cells = [r["metric"], r["unit"], *[_value_text(r["values"][n], r["unit"]) for n in names],
                 *[_delta_text(r["delta"][n], r["unit"]) for n in names[1:]]]
        lines.append("| " + " | ".join(cells) + " |")
    if any(v is None for r in rows for v in r["values"].values()):
        lines += ["", "`–`: no value. For an in-context task: its episodes with that many examples do not fit "
                      "the context window (`model.max_seq_len`), so none was scored; otherwise the measurement "
                      "does not apply to that run."]
    return "\n".join(lines)


def details_markdown(result: dict) -> list[str]:
    """Per run, one row per visit of the plan: head-mean first-token / content mass, entropy,
    expert load max/mean, divergence to the previous visit of the same layer, logit-lens loss."""
    out = []
    for name, a in result["analysis"].items():
        div = {(d["layer"], d["visits"][1]): d["divergence"] for d in a["routing"]["divergence"]}
        lens = a["logit_lens"]["depths"]
        out += [f"## {name}: per visit", "",
                "| depth | visit | first-token mass | content mass | entropy (nats) | load max/mean | "
                "routing divergence to previous visit | logit-lens loss (nats/token) |",
                "|---|---|---|---|---|---|---|---|"]
        for key, rec in sorted(a["attention"].items(), key=lambda kv: kv[1]["plan_index"]):
            d = rec["plan_index"] + 1
            route = a["routing"]["visits"].get(key)
            dv = div.get((rec["layer"], rec["visit"]))
            out.append(f"| {d} | {key} | {rec['mean']['first_mass']:.3f} | {rec['mean']['content_mass']:.3f} | "
                       f"{rec['mean']['entropy']:.3f} | " + (f"{route['load_max_over_mean']:.2f}" if route else "–")
                       + " | " + (f"{dv:.3f}" if dv is not None else "–") + f" | {lens[d]['loss']:.4f} |")
        out += _visit_intervals(a)
        bounds = a["logit_lens"]["boundaries"]
        if bounds:
            out += ["", "Loop boundaries (early-exit candidates): " + "; ".join(
                f"{b['label']} (depth {b['depth']}): loss {b['loss']:.4f}, +{b['loss_gap_to_final']:.4f} vs final, "
                f"top-1 agrees with final on {b['agree_final']:.1%}" for b in bounds)]
        out.append("")
    return out


def _interval_text(iv: dict, sign: str = "+") -> str:
    f = f"{sign}.4f"
    if iv.get("low") is None:
        return f"{iv['difference']:{f}} (no interval: {iv['interval']})"
    return f"{iv['difference']:{f}} [{iv['low']:{f}}, {iv['high']:{f}}]"


def _visit_intervals(a: dict) -> list[str]:
    """Per looped layer: last minus first visit's first-token mass and the routing divergence
    between visits, each with its bootstrap 95% interval over validation windows."""
    # the first pair of visits (0 -> 1) of each layer; later pairs (3 or more repeats) are in the per-visit table
    div = {d["layer"]: d for d in a["routing"]["divergence"] if d.get("divergence_interval") and d["visits"][0] == 0}
    rows = [c for c in a["attention_visits"] if c.get("delta_first_mass_interval")]
    if not rows:
        return []
    n = rows[0]["delta_first_mass_interval"]["n"]
    out = ["", f"Looped layers, last visit vs first, over {n} validation windows (mean of the per-window values, "
               "bootstrap 95% interval, BCa; the sink difference is paired by window):", "",
           "| layer | first-token mass, first visit | last visit | Δ [95% interval] | "
           "routing divergence, visit 0 to 1 [95% interval] |",
           "|---|---|---|---|---|"]
    for c in rows:
        dv = div.get(c["layer"])
        out.append(f"| {c['layer']} | {c['first_mass'][0]:.4f} | {c['first_mass'][-1]:.4f} | "
                   f"{_interval_text(c['delta_first_mass_interval'])} | "
                   + (_interval_text(dv["divergence_interval"], sign="") if dv else "–") + " |")
    return out


def write_report(result: dict, rows: list[dict], out_dir: Path, stem: str) -> tuple[Path, Path]:
    """Write ``<stem>.json`` (the whole result plus ``table``) and ``<stem>.md``. Returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [r["name"] for r in result["runs"]]
    jpath, mpath = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    write_json_atomic(jpath, {**result, "table": rows})
    md = [f"# smelt-ds {result['kind']}: " + " vs ".join(names), "",
          "Runs: " + "; ".join(f"{r['name']} ({r['unique_layers']} unique layers, {r['visits']} visits, "
                               f"{r['num_experts']} experts, {r['non_embedding_params']:,} non-embedding params)"
                               for r in result["runs"]), "",
          f"Δ = run minus {names[0]}.", ""]
    md += [f"Note: {n}" for n in result.get("notes", [])]
    md += ["", to_markdown(rows, names), ""]
    if result["kind"] == "analysis":
        md += details_markdown(result)
    write_text_atomic(mpath, "\n".join(md))
    return jpath, mpath
