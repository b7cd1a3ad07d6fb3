"""``smelt-ds eval --harness`` / ``--loop-repeats`` and ``smelt-ds lm-eval`` end to end on the
random-weight exports, with the tiny task files of :mod:`tests.eval.test_harness`: the files
written, their numbers against the harness's own results JSON and against an in-process
:func:`evaluate_model`, the Baseline's "no loop" row, and lm-eval's command line in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from smelt_ds.config.loop import loop_with_repeats
from smelt_ds.cost.budget import compute_budget
from smelt_ds.eval.data import open_eval_data
from smelt_ds.eval.harness import evaluate_model
from smelt_ds.eval.harness_report import metric_table
from smelt_ds.runs.load import load_run
from tests.eval.eval_test_utils import png_not_blank, png_size
from tests.eval.test_harness import offline, write_tasks  # noqa: F401  (offline: autouse fixture)

REPO = Path(__file__).resolve().parents[2]


def _cli(*argv) -> int:
    from smelt_ds.cli import main

    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli-tasks")
    write_tasks(root, ["a", "b", "c", "d"])
    return root


@pytest.mark.slow
def test_eval_harness_two_runs_two_k(tmp_path, random_exports, tasks_dir, capsys):
    out = tmp_path / "out"
    assert _cli("eval", random_exports["baseline"], random_exports["smelt"], "--harness", "t_mc,t_ll",
                "--include-path", tasks_dir, "--num-fewshot", "0,1", "--harness-batch-size", "2", "-o", out) == 0
    names = ["tiny-baseline", "tiny-smelt"]
    report = json.loads((out / "harness.json").read_text())
    assert [c["name"] for c in report["columns"]] == names and report["baseline"] == "tiny-baseline"
    assert [c["visits"] for c in report["columns"]] == [6, 6]
    rows = {(r["num_fewshot"], r["task"], r["metric"]): r for r in report["table"]}
    assert set(rows) == {(k, t, m) for k in ("0", "1") for t, ms in (("t_mc", ("acc", "acc_norm")),
                                                                  ("t_ll", ("perplexity", "acc"))) for m in ms}
    for name in names:
        for k in (0, 1):
            d = out / "harness" / f"{name}_k{k}"
            res = json.loads((d / "results.json").read_text())  # the harness's own JSON
            assert res["n-shot"] == {"t_mc": k, "t_ll": k} and "samples" not in res
            assert report["files"][name][str(k)] == f"harness/{name}_k{k}/results.json"
            for task in ("t_mc", "t_ll"):
                for metric, cell in metric_table(res)[task].items():
                    row = rows[(str(k), task, metric)]
                    assert row["values"][name] == cell["value"] == res["results"][task][f"{metric},none"]
                    assert row["stderr"][name] == cell["stderr"]
                samples = [json.loads(x) for x in (d / f"samples_{task}.jsonl").read_text().splitlines()]
                assert sorted(s["doc_id"] for s in samples) == list(range(4))
    r = rows[("1", "t_mc", "acc")]
    assert r["delta"]["tiny-smelt"] == r["values"]["tiny-smelt"] - r["values"]["tiny-baseline"]
    md = (out / "harness.md").read_text()
    assert "| task | metric | k | tiny-baseline | tiny-smelt | Δ tiny-smelt |" in md
    assert f"| t_ll | perplexity | 0 | {rows[('0', 't_ll', 'perplexity')]['values']['tiny-baseline']:.4f} ±" in md
    # the stratified report: by length (k=0) and by k, SMELT vs the Baseline
    strat = json.loads((out / "stratified.json").read_text())
    assert strat["baseline"] == "tiny-baseline" and strat["runs"] == names
    comps = {(c["task"], c["metric"]): c for c in strat["comparisons"]}
    assert {("t_mc", "acc"), ("t_ll", "nll"), ("t_ll", "acc")} <= set(comps)
    assert comps[("t_mc", "acc")]["fewshot"]["ks"] == [0, 1]
    k1 = [x for x in comps[("t_mc", "acc")]["fewshot"]["rows"] if x["k"] == 1][0]
    assert k1["mean_run"] == rows[("1", "t_mc", "acc")]["values"]["tiny-smelt"]
    assert k1["mean_baseline"] == rows[("1", "t_mc", "acc")]["values"]["tiny-baseline"]
    assert (out / "stratified.md").is_file()
    pngs = sorted(out.glob("stratified_*.png"))
    assert pngs and all(png_size(p)[0] > 200 and png_not_blank(p) for p in pngs)
    assert not (out / "eval.json").exists()  # --harness skips the loss / in-context pass
    # the in-process API gives the same numbers (batch size 2 as in the command)
    smelt = load_run(random_exports["smelt"])
    data = open_eval_data(smelt.cfg)
    direct = evaluate_model(smelt.model, data.tokenizer, data.eot_id, ["t_mc", "t_ll"], str(tasks_dir),
                            num_fewshot=1, batch_size=2, seed=0)
    assert direct["results"] == json.loads((out / "harness" / "tiny-smelt_k1" / "results.json").read_text())["results"]


@pytest.mark.slow
def test_eval_harness_loop_repeats_and_baseline_no_loop(tmp_path, random_exports, tasks_dir):
    out = tmp_path / "out"
    assert _cli("eval", random_exports["baseline"], random_exports["smelt"], "--harness", "t_mc",
                "--include-path", tasks_dir, "--num-fewshot", "0", "--loop-repeats", "1,2", "--no-plots",
                "-o", out) == 0
    report = json.loads((out / "harness.json").read_text())
    cols = {c["name"]: c for c in report["columns"]}
    assert list(cols) == ["tiny-baseline (no loop)", "tiny-smelt (R=1)", "tiny-smelt (R=2)"]
    assert [c["visits"] for c in cols.values()] == [6, 4, 6] and cols["tiny-baseline (no loop)"]["repeats"] is None
    cfg = load_run(random_exports["smelt"]).cfg
    for R in (1, 2):  # the budgets printed are those of the plan run
        plan_cfg = cfg.model_copy(update={"loop": loop_with_repeats(cfg.loop, cfg.model.num_layers, R)})
        assert cols[f"tiny-smelt (R={R})"]["flops_per_token"] == compute_budget(plan_cfg).forward_flops_per_token
    assert cols["tiny-smelt (R=1)"]["kv_cache_bytes_per_token"] < cols["tiny-smelt (R=2)"]["kv_cache_bytes_per_token"]
    for d in ("tiny-baseline_k0", "tiny-smelt_r1_k0", "tiny-smelt_r2_k0"):
        res = json.loads((out / "harness" / d / "results.json").read_text())
        assert res["config"]["visits"] == {"tiny-baseline_k0": 6, "tiny-smelt_r1_k0": 4, "tiny-smelt_r2_k0": 6}[d]
    # R=2 is the trained plan: the same numbers as without the option
    plain = tmp_path / "plain"
    assert _cli("eval", random_exports["smelt"], "--harness", "t_mc", "--include-path", tasks_dir,
                "--num-fewshot", "0", "-o", plain) == 0
    a = json.loads((out / "harness" / "tiny-smelt_r2_k0" / "results.json").read_text())["results"]
    b = json.loads((plain / "harness" / "tiny-smelt_k0" / "results.json").read_text())["results"]
    assert a == b
    assert "no loop" in (out / "harness.md").read_text()


def test_eval_loop_repeats_without_harness_writes_a_loss_table(tmp_path, random_exports):
    out = tmp_path / "out"
    assert _cli("eval", random_exports["baseline"], random_exports["smelt"], "--loop-repeats", "1,3",
                "--batches", "1", "--micro-batch", "2", "-o", out) == 0
    res = json.loads((out / "loop_repeats.json").read_text())
    rows = {(r["run"], r["label"]): r for r in res["rows"]}
    assert set(rows) == {("tiny-baseline", "no loop"), ("tiny-smelt", "R=1"), ("tiny-smelt", "R=3")}
    assert rows[("tiny-smelt", "R=3")]["visits"] == 8 and rows[("tiny-smelt", "R=1")]["kv_cache_slots"] == 4
    assert "| tiny-smelt | R=3 | 8 | 8 |" in (out / "loop_repeats.md").read_text()
    assert not (out / "eval.json").exists()


@pytest.mark.slow
def test_eval_harness_refusals(tmp_path, random_exports, tasks_dir, capsys):
    run = random_exports["smelt"]
    assert _cli("eval", run, "--harness", "t_mc", "--num-fewshot", "0,x", "-o", tmp_path) == 2
    assert "--num-fewshot" in capsys.readouterr().err
    assert _cli("eval", run, "--harness", "nope", "--include-path", tasks_dir, "-o", tmp_path) == 2
    assert "unknown harness task" in capsys.readouterr().err
    assert _cli("eval", run, "--harness", "t_mc", "--include-path", tmp_path / "missing", "-o", tmp_path) == 2
    assert "--include-path" in capsys.readouterr().err
    # a flag of a pass that was not asked for would be ignored: refused, naming it
    assert _cli("eval", run, "--limit", "5", "-o", tmp_path) == 2
    assert "--limit belong(s) to the --harness pass" in capsys.readouterr().err
    assert _cli("eval", run, "--allow-code-execution", "-o", tmp_path) == 2
    assert "--allow-code-execution belong(s) to the --humaneval pass" in capsys.readouterr().err


def test_eval_harness_checks_an_offline_task_directory(tmp_path, random_exports, capsys):
    """A k above a task's max_fewshot and a partial build are refused before any model runs."""
    from smelt_ds.eval import offline_tasks as ot

    d = tmp_path / "tasks"
    d.mkdir()
    (d / ot.MARKER_FILE).write_text("x\n")
    args = ("eval", random_exports["smelt"], "--harness", "smelt_offline", "--include-path", d, "-o", tmp_path / "o")
    assert _cli(*args) == 2
    assert "partial `smelt-ds eval build-tasks` output" in capsys.readouterr().err
    (d / ot.MANIFEST_FILE).write_text(json.dumps({"group": {"name": "smelt_offline"}, "tasks": {
        "smelt_lambada_prose": {"max_fewshot": 16, "examples": 45}, "smelt_prose_rolling": {"max_fewshot": 0,
                                                                                            "examples": 16}}}))
    assert _cli(*args, "--num-fewshot", "0,20") == 2
    assert "`--num-fewshot` 20 exceeds smelt_lambada_prose's 16" in capsys.readouterr().err


def test_old_outputs_are_cleared(tmp_path):
    from smelt_ds.eval.cli import _clear_old_outputs

    (tmp_path / "harness" / "old_k0").mkdir(parents=True)
    for name in ("stratified.md", "stratified.json", "stratified_t_acc.png", "eval.md"):
        (tmp_path / name).write_text("old")
    _clear_old_outputs(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.md"]  # another pass's files stay


@pytest.mark.slow
def test_lm_eval_command_line_in_a_subprocess(tmp_path, random_exports, tasks_dir):
    """``smelt-ds lm-eval run --model smelt-ds ...``: lm-eval's own CLI and output files, with the
    numbers of the in-process evaluation on the same 2 documents (batch size 1 both)."""
    out = tmp_path / "lm-eval-out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "smelt_ds.cli", "lm-eval", "run", "--model", "smelt-ds", "--model_args",
           f"pretrained={random_exports['smelt']}", "--tasks", "t_mc", "--include_path", str(tasks_dir),
           "--limit", "2", "--batch_size", "4", "--output_path", str(out), "--log_samples"]
    cmd[cmd.index("--model_args") + 1] += ",batch_size=1"  # --model_args wins over lm-eval's own --batch_size
    p = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    files = sorted(out.rglob("results_*.json"))
    assert len(files) == 1, sorted(out.rglob("*"))
    res = json.loads(files[0].read_text())
    assert res["config"]["model"] == "smelt-ds" and res["config"]["visits"] == 6 and res["n-samples"]["t_mc"][
        "effective"] == 2
    samples = [json.loads(x) for x in sorted(out.rglob("samples_t_mc_*.jsonl"))[0].read_text().splitlines()]
    smelt = load_run(random_exports["smelt"])
    data = open_eval_data(smelt.cfg)
    direct = evaluate_model(smelt.model, data.tokenizer, data.eot_id, ["t_mc"], str(tasks_dir), limit=2,
                            batch_size=1, log_samples=True)
    assert res["results"]["t_mc"]["acc,none"] == direct["results"]["t_mc"]["acc,none"]
    got = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}  # the tracker writes repr strings
    want = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in direct["samples"]["t_mc"]}
    assert got == want  # per-choice log-likelihoods, exactly


def test_lm_eval_help_says_why_plain_lm_eval_cannot_find_the_model(capsys):
    assert _cli("lm-eval", "--help") == 0
    out = capsys.readouterr()
    assert "usage: lm-eval" in out.out  # lm-eval's own help, the argument passed on unchanged
    assert "cannot find this model" in out.err and "MODEL_MAPPING" in out.err


def test_build_tasks_and_humaneval_are_dispatched(tmp_path, random_exports, capsys):
    with pytest.raises(SystemExit) as e:
        _cli("eval", "build-tasks", "--help")
    assert e.value.code == 0 and "usage: smelt-ds eval build-tasks" in capsys.readouterr().out
    assert _cli("eval", "build-tasks", tmp_path / "tasks", "--max-examples", "0") == 2  # its own checks ran
    assert "--max-examples" in capsys.readouterr().err
    out = tmp_path / "he"
    assert _cli("eval", random_exports["smelt"], "--humaneval", "--humaneval-limit", "1", "--humaneval-loss-only",
                "-o", out) == 0
    he = json.loads((out / "humaneval.json").read_text())
    assert he["problems"] == 1 and list(he["results"]) == ["tiny-smelt"] and not (out / "eval.json").exists()
