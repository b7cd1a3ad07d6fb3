"""`smelt-ds eval`, `analyze` and `generate` end to end on a trained tiny SMELT run (20 steps)
next to a random-weight Baseline export: files, value ranges, plots, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from smelt_ds.errors import ConfigError
from tests.eval.eval_test_utils import png_not_blank, png_size


def _cli(*argv) -> int:
    from smelt_ds.cli import main

    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def eval_out(tmp_path_factory, random_exports, trained_run):
    out = tmp_path_factory.mktemp("eval-out")
    assert _cli("eval", random_exports["baseline"], trained_run, "-o", out, "--batches", "2", "--micro-batch", "4",
                "--episodes", "6", "--shots", "0,1,4", "--tasks", "kv_recall,pattern,complete") == 0
    return out


@pytest.fixture(scope="module")
def analysis_out(tmp_path_factory, random_exports, trained_run):
    out = tmp_path_factory.mktemp("analysis-out")
    assert _cli("analyze", random_exports["baseline"], trained_run, "-o", out, "--batches", "1",
                "--micro-batch", "2") == 0
    return out


def _check_figures(out, result):
    assert result["figures"]
    for name, (w, h) in result["figures"].items():
        path = out / name
        assert path.stat().st_size > 2000, name
        assert png_size(path) == (w, h), name
        assert 200 <= w <= 1600 and 150 <= h <= 1200, name
        assert path.stat().st_size < 150_000, name
        assert png_not_blank(path), name


def test_eval_table_files_and_ranges(eval_out, trained_run, capsys):
    res = json.loads((eval_out / "eval.json").read_text())
    names = [r["name"] for r in res["runs"]]
    assert names == ["tiny-baseline", "tiny-smelt"]
    assert [r["visits"] for r in res["runs"]] == [6, 6] and res["runs"][1]["unique_layers"] == 4
    assert (trained_run / "exports" / "step00000020" / "model.pt").is_file()  # run directory consolidated once
    ln_v = math.log(512)
    for n in names:
        for d in ("code", "text", "all"):
            r = res["domains"][n][d]
            assert 0 < r["loss"] < 2 * ln_v and 0 < r["bits_per_byte"] < 10
            assert r["tokens"] == (2 * 4 * 32 if d != "all" else 2 * 2 * 4 * 32)
            assert [(b["start"], b["end"]) for b in r["positions"]] == [(1, 8), (9, 16), (17, 32)]
        for curve in res["icl"][n].values():
            assert list(curve) == ["0", "1", "4"]
            for v in curve.values():
                if v is not None:
                    assert 0 <= v["accuracy"] <= 1 and 0 < v["loss"] < 3 * ln_v
    # the trained run beats random weights on every domain
    for d in ("code", "text"):
        assert res["domains"]["tiny-smelt"][d]["loss"] < res["domains"]["tiny-baseline"][d]["loss"]
    rows = {(r["section"], r["metric"]): r for r in res["table"]}
    code = rows[("validation", "loss code")]
    assert code["delta"]["tiny-smelt"] == pytest.approx(code["values"]["tiny-smelt"] - code["values"]["tiny-baseline"])
    assert ("in-context: kv_recall", "k=4 accuracy") in rows
    md = (eval_out / "eval.md").read_text()
    assert "| metric | unit | tiny-baseline | tiny-smelt | Δ tiny-smelt |" in md
    assert set(res["figures"]) == {"eval_domains.png", "eval_positions.png", "eval_icl.png"}
    _check_figures(eval_out, res)


def test_analyze_files_and_ranges(analysis_out):
    res = json.loads((analysis_out / "analysis.json").read_text())
    for a in res["analysis"].values():
        assert len(a["attention"]) == 6 and len(a["logit_lens"]["depths"]) == 7
        for rec in a["attention"].values():
            for h in range(4):
                parts = rec["first_mass"][h] + rec["self_mass"][h] + rec["content_mass"][h]
                assert parts == pytest.approx(1.0, abs=1e-4)
                assert 0 <= rec["first_mass"][h] <= rec["top_mass"][h] <= 1 + 1e-6
                assert 0 <= rec["entropy"][h] <= math.log(32)
        for v in a["routing"]["visits"].values():
            assert sum(v["load"]) == pytest.approx(1.0) and v["load_max_over_mean"] >= 1.0
        assert a["logit_lens"]["final_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
    smelt = res["analysis"]["tiny-smelt"]
    assert [d["layer"] for d in smelt["routing"]["divergence"]] == [1, 2]
    assert all(0 <= d["divergence"] <= 1 for d in smelt["routing"]["divergence"])
    assert [b["depth"] for b in smelt["logit_lens"]["boundaries"]] == [1, 3, 5]
    assert res["analysis"]["tiny-baseline"]["routing"]["divergence"] == []
    # analysis.md: per looped layer the sink difference and divergence with their intervals, as in the JSON
    md = (analysis_out / "analysis.md").read_text()
    for c, d in zip(smelt["attention_visits"], smelt["routing"]["divergence"], strict=True):
        iv, dv = c["delta_first_mass_interval"], d["divergence_interval"]
        assert iv["n"] == dv["n"] == 2 * 2  # --batches 1 per domain x --micro-batch 2, two domains
        cell = f"{iv['difference']:+.4f}" + ("" if iv["low"] is None else f" [{iv['low']:+.4f}, {iv['high']:+.4f}]")
        assert f"| {c['layer']} | {c['first_mass'][0]:.4f} | {c['first_mass'][-1]:.4f} | {cell}" in md
    assert {"attention_sink.png", "routing.png", "logit_lens.png", "attention_heads_tiny-smelt.png",
            "routing_load_tiny-baseline.png"} <= set(res["figures"])
    _check_figures(analysis_out, res)
    rows = {(r["section"], r["metric"]): r for r in res["table"]}
    assert rows[("routing", "divergence between visits (mean over looped layers)")]["values"]["tiny-baseline"] is None


def test_generate_greedy_matches_full_recompute(trained_run, capsys):
    from smelt_ds.eval.data import open_eval_data
    from smelt_ds.eval.generation import encode_prompt, generate_text
    from smelt_ds.runs.load import load_run

    assert _cli("generate", trained_run, "--prompt", "def main(", "--max-new-tokens", "8", "--no-stop") == 0
    text = capsys.readouterr().out
    assert "--- greedy" in text and "--- sampled" in text and text.count("tokens/s") == 2
    run = load_run(trained_run)
    data = open_eval_data(run.cfg)
    ids = encode_prompt(data.tokenizer, "def main(", data.eot_id)
    got = generate_text(run.model, data.tokenizer, ids, 8)
    want = list(ids)
    with torch.no_grad():
        for _ in range(8):  # no KV cache: the whole sequence every step
            want.append(int(run.model(torch.tensor([want])).logits[0, -1].argmax()))
    assert got.ids == want and got.new_tokens == 8 and got.tokens_per_s > 0
    assert f"def main({got.text}" in text
    limit = run.cfg.model.max_seq_len
    with pytest.raises(ConfigError, match=rf"--max-new-tokens <= {limit - 10} or shorten"):
        generate_text(run.model, data.tokenizer, ids[:1] * 10, limit)
    with pytest.raises(ConfigError, match=rf"prompt \({limit + 5} tokens\) leaves no room .*at most {limit - 1}"):
        generate_text(run.model, data.tokenizer, ids[:1] * (limit + 5), 8)  # not "--max-new-tokens <= -5"


def test_generate_with_a_test_time_loop_count(random_exports, capsys):
    """--loop-repeats 3: the printed plan has 8 visits and the text is the greedy decode of a model
    whose plan was set to 3 repeats (reference: the same weights with set_loop, full recompute)."""
    from smelt_ds.config.loop import loop_with_repeats
    from smelt_ds.eval.data import open_eval_data
    from smelt_ds.eval.generation import encode_prompt
    from smelt_ds.runs.load import load_run

    args = ("generate", random_exports["smelt"], "--prompt", "def f(", "--max-new-tokens", "6", "--no-stop",
            "--mode", "greedy", "--json")
    assert _cli(*args, "--loop-repeats", "3") == 0
    got = json.loads(capsys.readouterr().out)[0]["ids"]
    assert _cli(*args) == 0
    trained = json.loads(capsys.readouterr().out)[0]["ids"]
    run = load_run(random_exports["smelt"])
    run.model.set_loop(loop_with_repeats(run.cfg.loop, run.cfg.model.num_layers, repeats=3))
    data = open_eval_data(run.cfg)
    want = encode_prompt(data.tokenizer, "def f(", data.eot_id)
    with torch.no_grad():
        for _ in range(6):
            want.append(int(run.model(torch.tensor([want])).logits[0, -1].argmax()))
    assert got == want and got != trained
    assert _cli("generate", random_exports["smelt"], "--prompt", "x", "--max-new-tokens", "2", "--mode", "greedy",
                "--exit-after", "1") == 0
    out = capsys.readouterr().out
    assert "4 visits [0, 1, 2, 3]" in out and "per-visit KV cache (4 slots)" in out
    assert _cli("generate", random_exports["baseline"], "--prompt", "x", "--loop-repeats", "2") == 2
    assert "no loop range" in capsys.readouterr().err


def test_generate_places_the_model_where_device_and_dtype_say(random_exports, capsys):
    """--device/--dtype as eval's: bfloat16 on the CPU decodes with a bf16 model (its greedy ids equal
    generate_text's on the same model cast to bf16, the same computation) and says where; CUDA on a
    machine without it is one error."""
    from smelt_ds.eval.data import open_eval_data
    from smelt_ds.eval.generation import encode_prompt, generate_text
    from smelt_ds.runs.load import load_run

    args = ("generate", random_exports["smelt"], "--prompt", "def f(", "--max-new-tokens", "4", "--no-stop",
            "--mode", "greedy", "--json")
    assert _cli(*args, "--device", "cpu", "--dtype", "bfloat16") == 0
    captured = capsys.readouterr()
    got = json.loads(captured.out)[0]["ids"]
    assert "decoding on cpu in bfloat16" in captured.err and "losses" not in captured.err
    run = load_run(random_exports["smelt"])
    run.model.to(torch.bfloat16)
    data = open_eval_data(run.cfg)
    want = generate_text(run.model, data.tokenizer, encode_prompt(data.tokenizer, "def f(", data.eot_id), 4).ids
    assert got == want and next(run.model.parameters()).dtype == torch.bfloat16
    if not torch.cuda.is_available():
        assert _cli(*args, "--device", "cuda") == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_bad_input_is_one_clear_error(tmp_path, random_exports, capsys):
    assert _cli("eval", tmp_path / "nope") == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert _cli("analyze", tmp_path / "empty") == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err
    assert _cli("eval", random_exports["smelt"], "--seq-len", "100", "-o", tmp_path / "o") == 2
    assert "`--seq-len` (100) exceeds `model.max_seq_len` (64)" in capsys.readouterr().err
    assert _cli("eval", random_exports["smelt"], "--names", "a,b") == 2
    assert "`--names`" in capsys.readouterr().err
    assert _cli("generate", random_exports["smelt"], "--prompt", "x", "--max-new-tokens", "500") == 2
    assert "`--max-new-tokens` (500)" in capsys.readouterr().err


def test_eval_and_analyze_record_the_device_and_dtype_they_ran_in(eval_out, random_exports, tmp_path):
    """eval.json / analysis.json settings and a note of the .md say where the models ran: eval's default
    on this CPU machine is float32 (auto), analyze --dtype bfloat16 says bfloat16."""
    res = json.loads((eval_out / "eval.json").read_text())
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert res["settings"]["device"].startswith(want) and res["settings"]["dtype"] in ("float32", "bfloat16")
    out = tmp_path / "a"
    assert _cli("analyze", random_exports["smelt"], "-o", out, "--batches", "1", "--micro-batch", "2",
                "--device", "cpu", "--dtype", "bfloat16", "--no-plots") == 0
    res = json.loads((out / "analysis.json").read_text())
    assert (res["settings"]["device"], res["settings"]["dtype"]) == ("cpu", "bfloat16")
    assert "computed with the models on cpu in bfloat16" in (out / "analysis.md").read_text()
