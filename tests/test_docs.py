"""The manual beyond its command examples (those are tests/test_examples.py's): README.md's links
resolve (``mkdocs build --strict`` checks the links inside docs/), every repository path a page
names in a code span exists (a moved module or renamed test is caught), the cluster walkthrough's recipe
is the shipped M recipe with the reader's data, and the console excerpts of README.md and
docs/training.md are what the training console prints for the tiny recipe, with the numbers of the
one file that holds the tiny runs' results (``docs/results/tiny_runs.json``, rewritten with the pages
by ``scripts/tiny_results.py``)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from smelt_ds.config.loading import load_config
from smelt_ds.cost.budget import compute_budget
from smelt_ds.parallel.threads import ThreadChoice
from smelt_ds.train.console import banner, step_line, summary_lines, val_line
from tests.test_examples import DOC_PAGES as PAGES
from tests.test_examples import ROOT, _pointer_exists, fenced_blocks, walkthrough_recipe

README = ROOT / "README.md"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation other than ``-`` and
    ``_`` dropped, spaces as ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (outside code blocks)."""
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.+)$", line)):
            out.add(github_anchor(m.group(1)))
    return out


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def broken_links(page: Path) -> list[str]:
    """Relative links of a page (outside code blocks) whose file, or heading anchor in a Markdown
    file, does not exist."""
    fenced, kept = False, []
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    text = "\n".join(kept)
    bad = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target} (no file {file})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{target} (no heading with anchor #{anchor} in {file})")
    return bad


def test_readme_links_resolve():
    assert broken_links(README) == []
    assert len(_LINK.findall(README.read_text())) >= 10  # the task table links the manual


def test_link_check_catches_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# A heading: `smelt-ds plot`\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#a-heading-smelt-ds-plot) [f](c.md) [a](b.md#other) [w](https://x.org/y)\n"
                    "```bash\n[not a link](d.md)\n```\n")
    assert github_anchor("A heading: `smelt-ds plot`") == "a-heading-smelt-ds-plot"
    problems = broken_links(page)
    assert len(problems) == 2 and "c.md" in problems[0] and "#other" in problems[1], problems


#: a repository path in a code span: `smelt_ds/runs/export.py`, `tests/train/test_loop.py::test_x`, `recipes/m/`
_REPO_PATH = re.compile(r"`((?:smelt_ds|tests|bench|scripts|recipes|launchers|ds_configs|\.ci)/[^`\s*{}<>]*?)"
                        r"(?:::([\w\[\]-]+))?`")


def missing_repo_paths(text: str) -> list[str]:
    """The repository paths named in ``text``'s code spans that do not exist, and the ``file::test``
    pointers whose test function the file does not define."""
    bad = []
    for path, test in _REPO_PATH.findall(text):
        file = ROOT / path.rstrip("/")
        if not file.exists():
            bad.append(path)
        elif test and not _pointer_exists(f"{path}::{test}"):
            bad.append(f"{path}::{test}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_repository_paths_named_by_a_page_exist(page):
    assert missing_repo_paths(page.read_text()) == [], f"{page.relative_to(ROOT)} names paths that do not exist"


def test_path_check_catches_a_moved_module_and_a_renamed_test():
    text = "`smelt_ds/train/export.py`, `tests/train/test_loop.py::test_no_such_test`, `smelt_ds/files.py`"
    assert missing_repo_paths(text) == ["smelt_ds/train/export.py", "tests/train/test_loop.py::test_no_such_test"]


def test_cluster_walkthrough_recipe_is_the_shipped_m_recipe_with_the_readers_data(tmp_path):
    cfg = load_config(walkthrough_recipe(tmp_path))
    shipped = load_config(ROOT / "recipes" / "m" / "smelt.yaml")
    assert cfg.name == "m-smelt-pile"
    assert [s.kind() for s in cfg.data.sources] == ["megatron", "megatron"]
    assert cfg.tracking.trackers == ["wandb"]
    # everything but the data, tracking and name is the shipped M recipe: the walkthrough trains it
    for section in ("model", "moe", "moe_runtime", "loop", "train", "deepspeed", "cluster"):
        assert getattr(cfg, section) == getattr(shipped, section), section


# ---------------------------------------------------------------------------------------------
# console excerpts
# ---------------------------------------------------------------------------------------------

_NUMBER = r"([\d,]+(?:\.\d+)?(?:e[-+]\d+)?)"


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _excerpts() -> list[tuple[str, list[str]]]:
    """``(where, lines)`` of the text blocks of README.md and docs/training.md that show the tiny
    SMELT recipe's console."""
    out = []
    for page in (README, ROOT / "docs" / "training.md"):
        for lang, start, body in fenced_blocks(page.read_text()):
            if lang == "text" and "smelt-ds train: tiny-smelt" in body:
                out.append((f"{page.relative_to(ROOT)}:{start}", body))
    return out


def _step_row(line: str) -> tuple[int, int, dict, float | None]:
    """A printed step line read back: (step, max_steps, metrics row, eta in seconds)."""
    m = re.match(rf"^step +(\d+)/(\d+) \| loss {_NUMBER} \| lr {_NUMBER} \| grad_norm {_NUMBER} \| {_NUMBER} tok/s "
                 rf"\| {_NUMBER} TFLOP/s \| rss {_NUMBER} GiB \| eta (?:(\d+)m)?(\d+)s$", line)
    assert m, f"not a step line of the current format: {line!r}"
    g = m.groups()
    row = {"loss": _num(g[2]), "lr": _num(g[3]), "grad_norm": _num(g[4]), "tokens_per_s": _num(g[5]),
           "tflops_per_device": _num(g[6]), "memory_bytes": _num(g[7]) * 2**30}
    return int(g[0]), int(g[1]), row, 60 * int(g[8] or 0) + int(g[9])


def _summary_from(lines: list[str], budget: dict) -> dict:
    """The summary.json fields the excerpt's summary block shows, read back from it."""
    text = "\n".join(lines)
    s = {"budget": budget, "compile": "none"}
    if m := re.search(rf"summary: (\S+), {_NUMBER} steps, {_NUMBER} tokens", text):
        s.update(name=m.group(1), steps=int(_num(m.group(2))), tokens=int(_num(m.group(3))))
    if m := re.search(rf"throughput +{_NUMBER} tokens/s steady state \({_NUMBER} logged windows after the first\); "
                      rf"first window {_NUMBER} s, {_NUMBER} s of it", text):
        s.update(tokens_per_s=_num(m.group(1)), throughput_windows=int(_num(m.group(2))) + 1,
                 first_window_s=_num(m.group(3)), startup_s=_num(m.group(4)))
    if m := re.search(rf"train loss +{_NUMBER} \(LM {_NUMBER}\), mean over the last {_NUMBER} steps", text):
        s.update(final_train_loss=_num(m.group(1)), final_lm_loss=_num(m.group(2)), final_loss_steps=int(m.group(3)))
    s["validation_loss"] = {k: _num(v) for k, v in re.findall(rf"val \[(\w+)\] +{_NUMBER} nats/token", text)}
    if m := re.search(rf"unigram +{_NUMBER} nats/token", text):
        s["unigram_entropy_nats"] = _num(m.group(1))
    return s


@pytest.mark.parametrize("where,lines", _excerpts(), ids=[w for w, _ in _excerpts()])
def test_console_excerpt_is_what_training_prints(where, lines):
    """Each banner, step, validation and summary line of the excerpt equals the line the console
    code prints for the tiny SMELT recipe on 1 CPU rank (the numbers a run measured read back from
    the excerpt; the recipe's own values, such as the budgets and the schedule, computed), and each
    step line's TFLOP/s is its tok/s times the recipe's training FLOPs per token."""
    cfg = load_config(ROOT / "recipes" / "tiny" / "smelt.yaml")
    budget = compute_budget(cfg, seq_len=cfg.train.seq_len)
    threads = ThreadChoice(2, "2 cores / 1 local rank; OMP_NUM_THREADS unset")
    expected = banner(cfg, run_dir="runs/tiny-smelt", world=1, accum=1, budget=budget, precision="fp32", device="cpu",
                      threads=threads).splitlines()
    windows = next((ln.split("val windows", 1)[1].strip() for ln in lines if ln.startswith("  val windows")), None)
    expected += summary_lines(_summary_from(lines, budget.as_dict()), "the mean of the domains' values, each domain "
                              "weighted equally", "runs/tiny-smelt", windows)
    shown = [ln for ln in lines if ln.strip() != "..." and not ln.startswith("smelt-ds data:")]
    assert len(shown) >= 8, where
    for line in shown:
        if line.startswith("step "):
            step, max_steps, row, eta = _step_row(line)
            assert step_line(step, max_steps, row, eta_s=eta) == line, where
            # TFLOP/s = tok/s x training FLOPs/token: the printed TFLOP/s is rounded to its last digit (half a
            # unit of it), the printed tok/s to an integer (relative 0.5 / tok/s, under 1e-3 here)
            flops = row["tokens_per_s"] * budget.train_flops_per_token / 1e12
            printed = re.search(rf"{_NUMBER} TFLOP/s", line).group(1)
            half_unit = 0.5 * 10.0 ** -len(printed.partition(".")[2])
            assert abs(flops - row["tflops_per_device"]) <= half_unit + 1e-3 * flops, (where, line, flops)
        elif line.startswith("val  step"):
            step = int(line.split("|")[0].split()[-1])
            val = {k: _num(v) for k, v in re.findall(rf"(\w+) {_NUMBER}", line.split("|", 1)[1])}
            assert val_line(step, val) == line, where
        else:
            assert line in expected, f"{where}: {line!r} is not a line the console prints for the tiny recipe"


def _tiny_results():
    spec = importlib.util.spec_from_file_location("tiny_results", ROOT / "scripts" / "tiny_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pages_quote_the_tiny_runs_as_the_results_file_gives_them():
    """Every number of the tiny runs a page quotes (the console excerpts, the spans of tiny.md) is the
    one in docs/results/tiny_runs.json, rendered by the console's own formatting."""
    tr = _tiny_results()
    results = json.loads(tr.RESULTS.read_text())
    pages = tr.render_pages(results)
    assert set(pages) == {"README.md", "docs/training.md", "docs/results/tiny.md"}
    for name, text in pages.items():
        assert (ROOT / name).read_text() == text, f"{name} disagrees with {tr.RESULTS}: python scripts/tiny_results.py"
    smelt = results["runs"]["tiny-smelt"]["summary"]["validation_loss"]
    assert f"code {smelt['code']:.4f}" in README.read_text()  # the excerpt shows the file's run
    assert tr.main(["--check"]) == 0


def test_a_hand_edited_number_or_an_unfinished_run_is_caught(tmp_path):
    tr = _tiny_results()
    results = json.loads(tr.RESULTS.read_text())
    code = results["runs"]["tiny-baseline"]["summary"]["validation_loss"]["code"]
    for name in ("README.md", "docs/training.md", "docs/results/tiny.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        text = (ROOT / name).read_text()
        if name.endswith("tiny.md"):  # another number in a span: the Baseline's code loss
            assert f"{code:.4f}" in text
            text = text.replace(f"{code:.4f}", f"{code + 0.0001:.4f}")
        (tmp_path / name).write_text(text)
    pages = tr.render_pages(results, root=tmp_path)
    assert pages["docs/results/tiny.md"] == (ROOT / "docs/results/tiny.md").read_text()
    assert pages["docs/results/tiny.md"] != (tmp_path / "docs/results/tiny.md").read_text()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 25, "loss": 7.0, "tokens_per_s": 1.0}) + "\n")
    with pytest.raises(tr.IncompleteRun, match=r"summary.json: missing"):
        tr.collect(run, "recipes/tiny/smelt.yaml")
    with pytest.raises(ValueError, match=r"tiny_runs:nope.*unknown span"):
        tr.rewrite_spans("<!-- tiny_runs:nope -->1<!-- /tiny_runs -->", results["runs"])


def test_the_step_lines_eta_is_the_consoles():
    """The eta a rendered step line shows is the training loop's: remaining steps times the window's
    seconds per step (25 steps of 1024 tokens at 8192 tokens/s: 3.125 s per window)."""
    tr = _tiny_results()
    row = {"step": 25, "loss_steps": 25, "skipped_steps": 0, "tokens": 25 * 1024, "tokens_per_s": 8192.0}
    assert tr._eta(row, 1000) == pytest.approx(975 * 3.125 / 25, rel=1e-12)


#: the `smelt-ds memory` runs whose output the pages quote: a line that marks the block -> (arguments, exit status)
MEMORY_EXCERPTS = {
    "of 79.10 GiB per GPU, +61.4%": ([], 0),
    "of 40.00 GiB per GPU": (["--nodes", "1", "--gpus-per-node", "2", "--device-memory", "40GiB"], 3),
}


def _printed(line: str, printed: list[str]) -> bool:
    """``line`` of an excerpt is a printed line: equal, a prefix (``...; ...``), or its parts around
    ``; ...;`` elisions in order inside one printed line."""
    if line.endswith("; ..."):
        return any(p.startswith(line[:-3]) for p in printed)
    parts = line.split("; ...; ")
    return any(p.startswith(parts[0]) and p.endswith(parts[-1]) and all(x in p for x in parts) for p in printed)


def test_memory_excerpts_are_what_the_command_prints(capsys):
    """The `smelt-ds memory recipes/m/smelt.yaml` outputs quoted by docs/memory.md and by the
    cluster walkthrough (whose recipe is the M recipe with the reader's data): every line shown
    is a line the command prints now, so the numbers in the pages are the tool's."""
    from smelt_ds.cli import main as cli_main

    outputs = {}
    for mark, (args, status) in MEMORY_EXCERPTS.items():
        assert cli_main(["memory", str(ROOT / "recipes" / "m" / "smelt.yaml"), *args]) == status
        outputs[mark] = capsys.readouterr().out.splitlines()
    shown = 0
    for page in ("docs/memory.md", "docs/cluster.md"):
        for lang, start, body in fenced_blocks((ROOT / page).read_text()):
            mark = next((m for m in MEMORY_EXCERPTS if lang == "text" and any(m in ln for ln in body)), None)
            if mark is None:
                continue
            for line in body:
                if line.strip() == "..." or line.startswith("exit status"):
                    continue
                assert _printed(line, outputs[mark]), f"{page}:{start}: {line!r} is not printed by smelt-ds memory"
                shown += 1
    assert shown >= 12  # memory.md's table excerpt and its verdict of a layout that does not fit, cluster.md's verdict
