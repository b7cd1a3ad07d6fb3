"""One validation-loss definition for training and ``smelt-ds eval``: on the same windows a
checkpoint's per-domain losses equal the in-loop ``val/*`` of ``metrics.jsonl``, and ``all`` is
the mean of the domains' values with every domain weighted equally, in both.

The run validates on 20 micro-batches of 4 windows per domain: the code domain fills them (80 of
its windows), the text domain holds fewer (60), so an equal-weight ``all`` and a token-weighted
(pooled) one differ and the test can tell them apart.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from smelt_ds.errors import ConfigError
from tests.markers import slow_fixture
from tests.numerics import lm_chain_length, prob_tol

EVAL_BATCHES = 20


def loss_rtol(raw: dict) -> float:
    """Training's validation (the engine's forward, its threads) and the evaluation (a plain forward)
    round differently: a token mean of the forward chain (Higham & Mary's bound, tests/numerics.py).
    A changed definition (token- instead of domain-weighted, other windows) moves a loss by > 1e-3."""
    from smelt_ds.config.loading import config_from_dict

    return prob_tol(lm_chain_length(config_from_dict(raw), 0, backward=False, seq=32) + EVAL_BATCHES * 4 * 32)


def _cli(*argv) -> int:
    from smelt_ds.cli import main

    return main([str(a) for a in argv])


def _raw(cache: Path, run_dir: Path) -> dict:
    from tests.eval.eval_test_utils import tiny_raw

    return tiny_raw(cache, run_dir, train={"max_steps": 6, "eval_every": 3, "save_every": 3, "log_every": 1},
                    eval={"eval_batches": EVAL_BATCHES})


@pytest.fixture(scope="module")
@slow_fixture
def run(tmp_path_factory, eval_cache, eval_data):
    """A tiny SMELT run (6 steps, validation and checkpoints at steps 3 and 6) and its in-loop
    validation rows ``{step: {domain: loss}}`` from metrics.jsonl."""
    from smelt_ds.testing import run_distributed
    from tests.eval.eval_test_utils import train_worker

    raw = _raw(eval_cache, tmp_path_factory.mktemp("definition") / "run")
    run_dir = Path(run_distributed(train_worker, 1, args=(raw,), timeout=300)[0])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = {r["step"]: {k[4:]: v for k, v in r.items() if k.startswith("val/")} for r in rows if "val/all" in r}
    assert sorted(val) == [3, 6]
    return {"dir": run_dir, "raw": raw, "val": val}


@pytest.fixture(scope="module")
def cli_eval(run, tmp_path_factory):
    """``smelt-ds eval RUN --training-windows`` on the final checkpoint: (eval.json, console text)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("definition-eval")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert _cli("eval", run["dir"], "--training-windows", "-o", out, "--no-plots", "--tasks", "kv_recall",
                    "--shots", "0", "--episodes", "1") == 0
    return json.loads((out / "eval.json").read_text()), buf.getvalue(), (out / "eval.md").read_text()


def _windows_per_domain(eval_data, ranks: int, per_rank_cap: int) -> dict[str, int]:
    """Training's validation windows, from the window counts of the loaders themselves."""
    from smelt_ds.data.loader import ValidationLoader

    out = {}
    for d in eval_data.domains:
        n = len(ValidationLoader(eval_data.prepared, d, 32, 4, dp_rank=0, dp_world_size=1).windows)
        out[d] = ranks * min(n // ranks, per_rank_cap)
    return out


def test_eval_with_training_windows_equals_in_loop_validation(run, cli_eval, eval_data):
    res, console, md = cli_eval
    per = res["domains"]["tiny-smelt"]
    want = run["val"][6]
    windows = _windows_per_domain(eval_data, 1, EVAL_BATCHES * 4)
    assert windows["code"] == EVAL_BATCHES * 4 and windows["text"] < EVAL_BATCHES * 4  # text is the short domain
    for d in eval_data.domains:
        assert per[d]["loss"] == pytest.approx(want[d], rel=loss_rtol(run["raw"])), d
        assert per[d]["windows"] == windows[d] and per[d]["tokens"] == windows[d] * 32
    # `all`: the domains' plain mean, in training and in the evaluation
    mean = sum(want[d] for d in eval_data.domains) / len(eval_data.domains)
    assert want["all"] == pytest.approx(mean, rel=1e-12)
    assert per["all"]["loss"] == pytest.approx(want["all"], rel=loss_rtol(run["raw"]))
    pooled = sum(per[d]["loss"] * per[d]["tokens"] for d in eval_data.domains) / per["all"]["tokens"]
    assert abs(pooled - per["all"]["loss"]) > 1e-3  # the token-weighted mean would be another number
    assert per["all"]["tokens"] == sum(per[d]["tokens"] for d in eval_data.domains)
    assert per["all"]["bits_per_byte"] == pytest.approx(
        sum(per[d]["bits_per_byte"] for d in eval_data.domains) / len(eval_data.domains), rel=1e-12)
    for i, bucket in enumerate(per["all"]["positions"]):
        assert bucket["loss"] == pytest.approx(
            sum(per[d]["positions"][i]["loss"] for d in eval_data.domains) / len(eval_data.domains), rel=1e-12)
    assert res["settings"] | {"seq_len": 32, "micro_batch_size": 4, "batches": EVAL_BATCHES, "ranks": 1,
                              "training_windows": True} == res["settings"]
    # both outputs state the definition and the windows
    rows = {r["metric"]: r for r in res["table"]}
    assert rows["loss all (domains weighted equally)"]["values"]["tiny-smelt"] == per["all"]["loss"]
    for text in (console, md):
        assert "`all`: the mean of the domains' values, each domain weighted equally" in text
        assert f"code {windows['code']} windows = {windows['code'] * 32:,} tokens" in text
        assert "equal its metrics.jsonl val/*" in text


def test_same_flags_on_an_earlier_checkpoint_equal_its_validation(run, eval_data):
    """Without --training-windows, flags naming the same windows give the same numbers (step 3);
    the default note points at --training-windows."""
    from smelt_ds.eval.suite import EvalSettings, evaluate_runs
    from smelt_ds.runs.load import load_run

    loaded = load_run(run["dir"] / "checkpoints" / "step00000003")
    res = evaluate_runs([loaded], EvalSettings(seq_len=32, micro_batch_size=4, batches=EVAL_BATCHES, tasks=()),
                        log=lambda *_: None)
    per = res["domains"][loaded.name]
    for d in (*eval_data.domains, "all"):
        assert per[d]["loss"] == pytest.approx(run["val"][3][d], rel=loss_rtol(run["raw"])), d
    assert run["val"][3]["code"] != pytest.approx(run["val"][6]["code"], rel=1e-3)  # another checkpoint indeed
    assert any("--training-windows evaluates exactly those" in n for n in res["notes"])


def test_summary_line_states_the_windows(run):
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.train.data import build_data
    from smelt_ds.train.validation import describe_validation, validation_windows

    cfg = config_from_dict(run["raw"])
    data = build_data(cfg, 0, 1)
    windows = validation_windows(data)
    read = {d: sum(b.input_ids.shape[0] for b in batches) for d, batches in data.validation(EVAL_BATCHES).items()}
    assert windows == read and windows["code"] == EVAL_BATCHES * 4 > windows["text"]
    line = describe_validation(data, cfg)
    assert line is not None
    assert line.startswith(f"code {EVAL_BATCHES * 4}, text {windows['text']} of 32 tokens")
    assert f"eval.eval_batches {EVAL_BATCHES} x train.micro_batch_size 4 x 1 rank)" in line
    assert "smelt-ds eval RUN --training-windows" in line


def _two_rank_validation(rank, world, raw, export):
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.runs.export import load_exported
    from smelt_ds.train.data import build_data
    from smelt_ds.train.validation import evaluate, validation_windows

    cfg = config_from_dict(raw)
    model = load_exported(export)  # the checkpoint's weights as the engine: evaluate() only calls forward
    data = build_data(cfg, rank, world)
    return {"val": evaluate(model, data, cfg), "windows": validation_windows(data)}


def test_two_rank_validation_equals_eval_with_ranks(run, eval_data):
    """Training's validation on 2 ranks (each rank every other window, sums all-reduced) equals the
    evaluation reading the windows the same way (``ranks=2``)."""
    from smelt_ds.eval.suite import EvalSettings, evaluate_runs
    from smelt_ds.runs.load import load_run
    from smelt_ds.testing import run_distributed

    export = load_run(run["dir"]).export_dir  # the newest checkpoint's export (written on first use)
    assert export.name == "step00000006" and (export / "model.pt").is_file()
    got = run_distributed(_two_rank_validation, 2, args=(run["raw"], export), timeout=300, init_deepspeed=False)
    assert got[0] == got[1]
    res = evaluate_runs([load_run(export)], EvalSettings(seq_len=32, micro_batch_size=4, batches=EVAL_BATCHES,
                                                         ranks=2, tasks=()), log=lambda *_: None)
    per = res["domains"]["tiny-smelt"]
    windows = _windows_per_domain(eval_data, 2, EVAL_BATCHES * 4)
    assert got[0]["windows"] == windows
    for d in (*eval_data.domains, "all"):
        assert per[d]["loss"] == pytest.approx(got[0]["val"][d], rel=loss_rtol(run["raw"])), d
    for d in eval_data.domains:
        assert per[d]["windows"] == windows[d]


def test_training_ranks_come_from_the_checkpoint_marker(run, tmp_path):
    from smelt_ds.eval.suite import training_windows
    from smelt_ds.runs.load import load_run

    export = run["dir"] / "exports" / "step00000006"
    assert training_windows(load_run(run["dir"])) == {"seq_len": 32, "micro_batch_size": 4, "batches": EVAL_BATCHES,
                                                      "ranks": 1}
    fake_ckpt = tmp_path / "ckpt"
    fake_ckpt.mkdir()
    (fake_ckpt / "COMPLETE").write_text(json.dumps({"step": 6, "world_size": 2}))
    copy = tmp_path / "export"
    shutil.copytree(export, copy)
    (copy / "SOURCE").write_text(f"{fake_ckpt}\n")
    assert training_windows(load_run(copy))["ranks"] == 2
    (copy / "SOURCE").unlink()
    with pytest.raises(ConfigError, match=r"--training-windows` needs the number of ranks .*/SOURCE is missing"):
        training_windows(load_run(copy))


@pytest.mark.parametrize("flag", [["--batches", "2"], ["--micro-batch", "4"], ["--seq-len", "16"],
                                  ["--corpus", "x.txt"]])
def test_training_windows_refuses_flags_that_choose_windows(flag, tmp_path, capsys):
    assert _cli("eval", tmp_path, "--training-windows", *flag) == 2
    assert f"so {flag[0]} cannot choose them too: drop --training-windows or the flag(s)" in capsys.readouterr().err
    assert _cli("eval", tmp_path, "--training-windows", "--loop-repeats", "1,2") == 2
    assert "--training-windows belongs to the validation-loss pass" in capsys.readouterr().err
