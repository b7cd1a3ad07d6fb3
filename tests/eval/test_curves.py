"""``smelt-ds plot`` (smelt_ds/eval/curves.py): the CSV holds the run's own metrics.jsonl numbers,
the FLOPs axis is the recipe's budget x tokens, the PNG is drawn, bad input is named.

The runs are written by hand (the shipped tiny recipes' resolved config.yaml and metrics.jsonl
rows in the training's format), so no test trains; one test reads the real run that the
evaluation tests train once per session (``trained_run``)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from smelt_ds import cli
from smelt_ds.config.loading import dump_config, load_config
from smelt_ds.cost.budget import compute_budget
from smelt_ds.errors import ConfigError
from smelt_ds.eval import curves

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"baseline": ROOT / "recipes/tiny/baseline.yaml", "smelt": ROOT / "recipes/tiny/smelt.yaml"}
TOKENS_PER_STEP = 8 * 128  # the tiny recipes: micro_batch_size 8 x seq_len 128, one process
TRAIN_STEPS = [10, 20, 30, 40, 50, 60]
VAL_STEPS = [30, 45, 60]  # 45: no training row there (tokens from the steps around it)
DOMAINS = ["code", "text"]


def _train_row(kind: str, step: int, plan) -> dict:
    offset = 0.1 if kind == "baseline" else 0.0
    row = {"step": step, "loss": 8.0 - step / 20 + offset, "lm_loss": 7.9 - step / 20 + offset, "aux_loss": 1.01,
           "loss_last_step": 7.95 - step / 20, "loss_steps": 10,
           "z_loss": 2.5, "lr": 3e-3 * min(1.0, step / 50), "grad_norm": 1.0 + 10 / step + offset,
           "tokens": step * TOKENS_PER_STEP, "tokens_per_s": 4000.0, "tflops_per_device": 0.05,
           "memory_bytes": 10**9}
    for v in plan:
        row[f"router/L{v.layer}V{v.visit}/load_max_over_mean"] = 1.5 + 0.1 * v.layer + 0.05 * v.visit - step / 1000
        row[f"router/L{v.layer}V{v.visit}/dropped_share"] = 0.0
    return row


def _val_row(kind: str, step: int) -> dict:
    vals = {d: 7.0 - step / 30 + 0.2 * i + (0.05 if kind == "baseline" else 0.0) for i, d in enumerate(DOMAINS)}
    return {"step": step, **{f"val/{d}": v for d, v in vals.items()}, "val/all": sum(vals.values()) / len(vals)}


def make_run(run_dir: Path, kind: str, steps=TRAIN_STEPS, val_steps=VAL_STEPS) -> list[dict]:
    """A run directory as `smelt-ds train` leaves it (config.yaml, ds_config.json, metrics.jsonl);
    returns the rows written."""
    cfg = load_config(RECIPES[kind])
    run_dir.mkdir(parents=True)
    dump_config(cfg, run_dir / "config.yaml")
    (run_dir / "ds_config.json").write_text(json.dumps({"train_batch_size": 8}))
    rows = []
    for s in sorted(set(steps) | set(val_steps)):
        if s in steps:
            rows.append(_train_row(kind, s, cfg.schedule.plan))
        if s in val_steps:
            rows.append(_val_row(kind, s))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def plotted(tmp_path_factory):
    """Baseline and SMELT plotted by the CLI entry point in a fresh interpreter."""
    tmp = tmp_path_factory.mktemp("plot")
    rows = {k: make_run(tmp / k, k) for k in ("baseline", "smelt")}
    out = tmp / "plots" / "tiny.png"
    proc = subprocess.run([sys.executable, "-m", "smelt_ds.cli", "plot", str(tmp / "baseline"), str(tmp / "smelt"),
                           "-o", str(out), "--labels", "Baseline,SMELT"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    return {"proc": proc, "rows": rows, "png": out, "csv": out.with_suffix(".csv"), "tmp": tmp}


def test_cli_returns_0_and_writes_png_and_csv(plotted):
    assert plotted["proc"].returncode == 0, plotted["proc"].stderr
    assert plotted["png"].is_file() and plotted["csv"].is_file()
    assert str(plotted["png"]) in plotted["proc"].stdout


def test_csv_holds_the_metrics_jsonl_numbers(plotted):
    table = read_csv(plotted["csv"])
    assert list(table[0]) == ["run", "step", "tokens", "train_flops", "metric", "value"]
    for kind, label in (("baseline", "Baseline"), ("smelt", "SMELT")):
        mine = [r for r in table if r["run"] == label]
        got = {(r["metric"], int(r["step"])): float(r["value"]) for r in mine}
        want = {(k, r["step"]): v for r in plotted["rows"][kind] for k, v in r.items()
                if k in ("loss", "lr", "grad_norm") or k.startswith("val/") or k.endswith("load_max_over_mean")}
        assert got == want  # every plotted number, exactly, and nothing else (no dropped_share, tokens_per_s...)
        assert {int(r["step"]) for r in mine if r["metric"] == "loss"} == set(TRAIN_STEPS)
        assert {int(r["step"]) for r in mine if r["metric"] == "val/text"} == set(VAL_STEPS)
        for r in mine:  # tokens per step is constant: validation rows (no 'tokens' of their own) included
            assert int(r["tokens"]) == int(r["step"]) * TOKENS_PER_STEP


def test_flops_column_is_the_recipe_budget_times_tokens(plotted):
    table = read_csv(plotted["csv"])
    per_token = {}
    for kind, label in (("baseline", "Baseline"), ("smelt", "SMELT")):
        cfg = load_config(RECIPES[kind])
        per_token[label] = compute_budget(cfg, cfg.train.seq_len).train_flops_per_token
    assert per_token["Baseline"] != per_token["SMELT"]  # matched within 1%, not equal: a swap would show
    for r in table:
        assert float(r["train_flops"]) == pytest.approx(per_token[r["run"]] * int(r["tokens"]), rel=1e-12)


def test_both_runs_appear_with_their_labels_and_visits(plotted):
    table = read_csv(plotted["csv"])
    assert {r["run"] for r in table} == {"Baseline", "SMELT"}
    loads = {lab: {r["metric"] for r in table if r["run"] == lab and r["metric"].startswith("router/")}
             for lab in ("Baseline", "SMELT")}
    assert loads["SMELT"] == {f"router/L{layer}V{visit}/load_max_over_mean"
                              for layer, visit in [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (3, 0)]}
    assert loads["Baseline"] == {f"router/L{layer}V0/load_max_over_mean" for layer in range(6)}


def _colour_pixels(img, rgb, tol=0.1) -> int:
    import numpy as np

    return int((np.abs(img[..., :3] - np.array(rgb)).max(axis=-1) < tol).sum())


def test_png_has_the_expected_size_and_every_panel_is_drawn(plotted):
    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(str(plotted["png"]))
    assert img.shape == (4 * 320, 1200, 4)  # 2 runs: 4 rows of two 6 x 3.2 in panels at 100 dpi
    blue, orange = (0x1F / 255, 0x77 / 255, 0xB4 / 255), (0xFF / 255, 0x7F / 255, 0x0E / 255)  # tab10 C0, C1
    cells = [img[r * 320:(r + 1) * 320, c * 600:(c + 1) * 600] for r in range(4) for c in range(2)]
    # loss vs tokens, vs FLOPs, LR, grad norm: a curve of each run (far more pixels than a legend's sample line)
    for cell in cells[:6]:
        assert _colour_pixels(cell, blue) > 150 and _colour_pixels(cell, orange) > 150
    for cell in cells[6:]:  # expert load, one panel per run: several colours drawn
        assert float(cell[..., :3].std()) > 0.05 and len(np.unique(cell[..., :3].reshape(-1, 3), axis=0)) > 50


def test_an_empty_panel_has_no_curve_pixels(tmp_path):
    """The pixel threshold above tells a drawn curve from an empty panel with its legend."""
    import matplotlib.image as mpimg

    make_run(tmp_path / "run", "smelt", steps=[], val_steps=[5, 10])  # validation rows only
    run = curves.load_curves(tmp_path / "run")
    curves.plot_curves([run], tmp_path / "one.png", x="tokens")
    img = mpimg.imread(str(tmp_path / "one.png"))
    assert img.shape == (3 * 320, 1200, 4)
    blue = (0x1F / 255, 0x77 / 255, 0xB4 / 255)
    assert _colour_pixels(img[:320, :600], blue) < 150  # train loss: no row, the legend's sample line only
    assert _colour_pixels(img[:320, 600:], blue) > 150  # validation: drawn


def test_a_run_still_writing_its_last_line_is_plotted_with_a_warning(tmp_path, capsys):
    rows = make_run(tmp_path / "run", "smelt", steps=[10, 20], val_steps=[25])
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 30, "loss": 6.')  # half of a row
    with pytest.warns(curves.IncompleteLineWarning, match="line 4 is incomplete"):
        run = curves.load_curves(tmp_path / "run")
    assert [s for s, _, _ in run.series["loss"]] == [10, 20]
    # validation at step 25, after the last training row: 25 steps of 1024 tokens
    assert run.series["val/all"] == [(25, 25 * TOKENS_PER_STEP, rows[-1]["val/all"])]
    assert cli.main(["plot", str(tmp_path / "run")]) == 0
    assert "warning" in capsys.readouterr().err
    assert (tmp_path / "run" / "curves.png").is_file() and (tmp_path / "run" / "curves.csv").is_file()


def test_validation_before_any_training_row_uses_ds_config(tmp_path):
    make_run(tmp_path / "run", "smelt", steps=[], val_steps=[5])
    run = curves.load_curves(tmp_path / "run")
    assert run.series["val/code"][0][:2] == (5, 5 * 8 * 128)  # train_batch_size 8 x seq_len 128


def test_a_run_without_config_yaml_takes_the_flops_from_summary_json(tmp_path):
    make_run(tmp_path / "run", "smelt")
    (tmp_path / "run" / "config.yaml").unlink()
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"budget": {"train_flops_per_token": 123.0}}))
    run = curves.load_curves(tmp_path / "run")
    assert run.label == "run" and run.flops(1000) == 123_000.0


def _error(argv, capsys) -> str:
    assert cli.main(["plot", *argv]) == 2
    return capsys.readouterr().err


@pytest.fixture
def good(tmp_path) -> Path:
    make_run(tmp_path / "good", "smelt")
    return tmp_path / "good"


def test_errors_name_the_path_and_the_line(tmp_path, good, capsys):
    (tmp_path / "notarun").mkdir()
    err = _error([str(good), str(tmp_path / "notarun")], capsys)
    assert "notarun" in err and "no metrics.jsonl" in err
    assert "does not exist" in _error([str(tmp_path / "missing")], capsys)

    make_run(tmp_path / "empty", "smelt")
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    err = _error([str(tmp_path / "empty")], capsys)
    assert str(tmp_path / "empty" / "metrics.jsonl") in err and "no metrics rows" in err

    lines = (good / "metrics.jsonl").read_text().splitlines(keepends=True)
    make_run(tmp_path / "damaged", "smelt")
    (tmp_path / "damaged" / "metrics.jsonl").write_text(lines[0] + '{"step": 20, "loss": \n' + "".join(lines[1:]))
    err = _error([str(tmp_path / "damaged")], capsys)
    assert str(tmp_path / "damaged" / "metrics.jsonl") in err and "line 2 is damaged" in err
    (tmp_path / "damaged" / "metrics.jsonl").write_text(lines[0] + "[1, 2]\n")
    assert "line 2 is not a metrics row" in _error([str(tmp_path / "damaged")], capsys)

    assert "gives 1 name(s) for 2 run(s)" in _error([str(good), str(good), "--labels", "A"], capsys)

    (tmp_path / "afile").write_text("")
    err = _error([str(good), "-o", str(tmp_path / "afile" / "out.png")], capsys)
    assert str(tmp_path / "afile" / "out.png") in err and "cannot be written" in err
    err = _error([str(good), "-o", str(tmp_path / "o.png"), "--csv", str(tmp_path / "afile" / "x.csv")], capsys)
    assert "--csv" in err and str(tmp_path / "afile" / "x.csv") in err
    assert not (tmp_path / "o.png").exists()  # checked before anything is drawn


def test_read_metrics_raises_for_a_damaged_last_line_with_its_newline(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n')  # complete (newline) but not JSON: damaged
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigError, match="line 2 is damaged"):
            curves.read_metrics(p)


def test_default_output_names(tmp_path, good):
    assert curves.output_paths([good], ["tiny-smelt"], None, None) == (good / "curves.png", good / "curves.csv")
    out = tmp_path / "figs"
    assert curves.output_paths([good, good], ["a", "b c"], str(out), None) == (out / "curves_vs_b_c.png",
                                                                               out / "curves_vs_b_c.csv")
    assert curves.output_paths([good], ["a"], "x/y.PNG", "z.csv") == (Path("x/y.PNG"), Path("z.csv"))


def test_plots_a_real_run(trained_run, tmp_path):
    """The run the evaluation tests train (20 steps, a row every 10, validation at 20) as the loop wrote it."""
    rows = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert cli.main(["plot", str(trained_run), "-o", str(tmp_path)]) == 0
    table = read_csv(tmp_path / "curves.csv")
    got = {(r["metric"], int(r["step"])): (float(r["value"]), int(r["tokens"])) for r in table}
    tokens = {r["step"]: r["tokens"] for r in rows if "tokens" in r}
    want = {(k, r["step"]): (v, tokens[r["step"]]) for r in rows for k, v in r.items()
            if k in ("loss", "lr", "grad_norm") or k.startswith("val/")}
    assert {k: v for k, v in got.items() if not k[0].startswith("router/")} == want
    assert any(k[0].endswith("load_max_over_mean") for k in got)
