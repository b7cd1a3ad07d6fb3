#!/usr/bin/env python
"""The tiny runs' numbers that the manual quotes: one file, ``docs/results/tiny_runs.json``, and
the places that show them, rewritten from it.

The manual quotes the 1000-step runs of ``recipes/tiny/smelt.yaml`` and
``recipes/tiny/baseline.yaml`` (the README's main job and its Baseline) in three places: the
console excerpts of ``README.md`` and ``docs/training.md`` (step, validation and summary lines of
the SMELT run) and the training-time validation losses of both runs in ``docs/results/tiny.md``
(between ``<!-- tiny_runs:NAME -->`` and ``<!-- /tiny_runs -->``). Each number is read from the
run directories once, into the JSON file, and every place is rendered from that file with the
console's own formatting (:mod:`smelt_ds.train.console`), so the places cannot disagree;
``tests/test_docs.py`` fails when a page no longer matches the file.

    python scripts/tiny_results.py --train        # train both recipes (runs/tiny-*), then as below
    python scripts/tiny_results.py                # read runs/tiny-smelt, runs/tiny-baseline: JSON + pages
    python scripts/tiny_results.py --smelt DIR --baseline DIR
    python scripts/tiny_results.py --check        # compare the pages with the JSON, write nothing

Exit status: 0, or 1 with ``--check`` when a page differs (naming it), 2 for a run directory
that is missing or incomplete (no ``summary.json``: the run did not finish).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from smelt_ds.files import write_text_atomic
from smelt_ds.train.console import step_line, summary_lines, val_line

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "tiny_runs.json"
#: pages with a console excerpt of the tiny SMELT run (a ``text`` block holding its banner)
EXCERPT_PAGES = ("README.md", "docs/training.md")
#: pages with ``<!-- tiny_runs:NAME -->...<!-- /tiny_runs -->`` spans (NAME: :data:`SPANS`)
SPAN_PAGES = ("docs/results/tiny.md",)
RUN_DIR_SHOWN = "runs/tiny-smelt"  # as the README's command prints it
VAL_NOTE = "the mean of the domains' values, each domain weighted equally"
#: the summary.json fields a page shows
SUMMARY_KEYS = ("name", "steps", "tokens", "tokens_per_s", "throughput_windows", "first_window_s", "startup_s",
                "compile", "final_train_loss", "final_lm_loss", "final_loss_steps", "validation_loss",
                "unigram_entropy_nats", "budget")
#: the metrics.jsonl fields a step line shows
ROW_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "memory_bytes", "loss_steps",
            "skipped_steps", "tokens")


class IncompleteRun(Exception):
    """A run directory without the files of a finished run."""


def collect(run_dir: Path, recipe: str) -> dict[str, Any]:
    """One run's numbers: ``summary`` (:data:`SUMMARY_KEYS` of ``summary.json``) and ``rows``, the
    first and last logged training rows of ``metrics.jsonl`` (:data:`ROW_KEYS`). Raises
    IncompleteRun naming the file when the run has not finished."""
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.jsonl"
    for path in (summary_path, metrics_path):
        if not path.is_file():
            raise IncompleteRun(f"{path}: missing; is {run_dir} a finished run of {recipe}? (train it: "
                                f"smelt-ds train {recipe} --set train.run_dir={run_dir}, or pass --train)")
    summary = json.loads(summary_path.read_text())
    rows = [r for r in map(json.loads, metrics_path.read_text().splitlines()) if "loss" in r and "tokens_per_s" in r]
    if not rows or rows[-1]["step"] != summary["steps"]:
        raise IncompleteRun(f"{metrics_path}: no training row at the last step {summary['steps']}")
    pick = [rows[0], rows[-1]]
    return {"recipe": recipe, "summary": {k: summary.get(k) for k in SUMMARY_KEYS},
            "rows": [{k: r.get(k) for k in ROW_KEYS} for r in pick]}


def _eta(row: dict[str, Any], max_steps: int) -> float:
    """The eta the console printed with this row (smelt_ds.train.loop: remaining steps x the
    window's seconds per step), the window's seconds recovered from its tokens and tokens/s."""
    steps = max(1, row["loss_steps"] + row["skipped_steps"])
    tokens_per_step = row["tokens"] / row["step"]
    seconds = row["loss_steps"] * tokens_per_step / row["tokens_per_s"]
    return (max_steps - row["step"]) * seconds / steps


def console_lines(run: dict[str, Any], val_windows: str | None) -> list[str]:
    """The console lines of ``run`` a page may show: first and last step lines, the validation
    line at the last step and the summary block (run dir as the README's command prints it)."""
    s = run["summary"]
    out = [step_line(r["step"], s["steps"], r, eta_s=_eta(r, s["steps"])) for r in run["rows"]]
    out.append(val_line(s["steps"], s["validation_loss"]))
    return out + summary_lines(s, VAL_NOTE, RUN_DIR_SHOWN, val_windows)


def _key(line: str) -> str:
    """What identifies a console line across runs: ``step N``, ``val  step``, ``summary:`` or a
    summary row's label."""
    if m := re.match(r"^(step +\d+)/", line):
        return m.group(1)
    if line.startswith(("val  step", "summary:")):
        return line[:9]
    return line[:16].rstrip()


def rewrite_excerpt(text: str, run: dict[str, Any]) -> str:
    """``text`` (a page) with every step, validation and summary line of its tiny-smelt console
    excerpts replaced by the line ``run`` gives; other lines (banner, ``...``) are kept."""
    def fix(block: re.Match) -> str:
        body = block.group(2)
        if "smelt-ds train: tiny-smelt" not in body:
            return block.group(0)
        lines = body.split("\n")
        windows = next((ln.split("val windows", 1)[1].strip() for ln in lines if ln.startswith("  val windows")), None)
        fresh = {_key(ln): ln for ln in console_lines(run, windows)}
        in_summary = False
        out = []
        for ln in lines:
            in_summary = in_summary or ln.startswith("summary:")
            key = _key(ln)
            generated = ln.startswith(("step ", "val  step")) or (in_summary and ln.strip() not in ("", "..."))
            if generated and key not in fresh:
                raise ValueError(f"console line {ln!r} has no counterpart in the run's console")
            out.append(fresh[key] if generated else ln)
        return block.group(1) + "\n".join(out) + block.group(3)

    return re.sub(r"(```text\n)(.*?)(\n```)", fix, text, flags=re.S)


def _val_span(runs: dict[str, Any]) -> str:
    smelt, base = (runs[n]["summary"]["validation_loss"] for n in ("tiny-smelt", "tiny-baseline"))
    return (f"code {smelt['code']:.4f} vs {base['code']:.4f}, text {smelt['text']:.4f} vs {base['text']:.4f} "
            "nats/token, SMELT vs Baseline")


def _unigram_gap_span(runs: dict[str, Any]) -> str:
    s = runs["tiny-smelt"]["summary"]
    return f"{s['unigram_entropy_nats'] - s['validation_loss']['all']:.1f}"


#: spans of docs/results/tiny.md, rendered from both runs: the training-time validation losses, and
#: how far the SMELT run's validation loss ends below the corpus's unigram entropy (nats/token)
SPANS = {"val": _val_span, "unigram_gap": _unigram_gap_span}


def rewrite_spans(text: str, runs: dict[str, Any]) -> str:
    """``text`` with each ``<!-- tiny_runs:NAME -->...<!-- /tiny_runs -->`` span rendered from
    ``runs``. Raises ValueError for an unknown NAME."""
    def fix(m: re.Match) -> str:
        name = m.group(1)
        if name not in SPANS:
            raise ValueError(f"<!-- tiny_runs:{name} -->: unknown span; known: {sorted(SPANS)}")
        return f"<!-- tiny_runs:{name} -->{SPANS[name](runs)}<!-- /tiny_runs -->"

    return re.sub(r"<!-- tiny_runs:(\w+) -->.*?<!-- /tiny_runs -->", fix, text, flags=re.S)


def render_pages(results: dict[str, Any], root: Path = ROOT) -> dict[str, str]:
    """Every page that quotes the runs, as :data:`RESULTS` ``results`` says it should read."""
    runs = results["runs"]
    pages = {name: rewrite_excerpt((root / name).read_text(), runs["tiny-smelt"]) for name in EXCERPT_PAGES}
    for name in SPAN_PAGES:
        pages[name] = rewrite_spans(pages.get(name, (root / name).read_text()), runs)
    return pages


def _machine() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"date": datetime.date.today().isoformat(), "commit": commit.stdout.strip(), "cpu": cpu,
            "cores": os.cpu_count(), "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smelt", default="runs/tiny-smelt", help="run directory of recipes/tiny/smelt.yaml")
    p.add_argument("--baseline", default="runs/tiny-baseline", help="run directory of recipes/tiny/baseline.yaml")
    p.add_argument("--train", action="store_true", help="train both recipes into those directories first")
    p.add_argument("--check", action="store_true", help="compare the pages with the JSON; write nothing")
    args = p.parse_args(argv)
    if args.check:
        stale = [name for name, text in render_pages(json.loads(RESULTS.read_text())).items()
                 if (ROOT / name).read_text() != text]
        for name in stale:
            print(f"{name} does not match {RESULTS.relative_to(ROOT)}: run `python scripts/tiny_results.py` "
                  "(with the run directories) to rewrite it", file=sys.stderr)
        return 1 if stale else 0
    recipes = {"tiny-smelt": ("recipes/tiny/smelt.yaml", args.smelt),
               "tiny-baseline": ("recipes/tiny/baseline.yaml", args.baseline)}
    if args.train:
        for recipe, run_dir in recipes.values():
            subprocess.run([sys.executable, "-m", "smelt_ds.train", recipe, "--set", f"train.run_dir={run_dir}"],
                           cwd=ROOT, check=True)
    try:
        runs = {name: collect(ROOT / run_dir, recipe) for name, (recipe, run_dir) in recipes.items()}
    except IncompleteRun as e:
        print(f"tiny_results: {e}", file=sys.stderr)
        return 2
    results = {"generated_by": "python scripts/tiny_results.py", "machine": _machine(), "runs": runs}
    write_text_atomic(RESULTS, json.dumps(results, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    for name, text in render_pages(results).items():
        if (ROOT / name).read_text() != text:
            write_text_atomic(ROOT / name, text)
            print(f"rewrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
