"""The training console and what it reports: banner, log and validation lines, the summary block,
the logged loss as the mean over the logging interval, steady-state throughput without the first
window, and bit-identical reruns with ``train.deterministic``."""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from smelt_ds.config.loading import config_from_dict
from smelt_ds.cost.budget import compute_budget
from smelt_ds.parallel.threads import ThreadChoice
from smelt_ds.testing import run_distributed
from smelt_ds.train.console import LABEL_WIDTH, Console, banner, format_duration, step_line, summary_lines, val_line
from smelt_ds.train.metrics import IntervalMeans, throughput


def _raw(run_dir: Path, cache: Path, **train):
    return {"name": "console",
            "model": {"vocab_size": 512, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                      "max_seq_len": 64},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32},
            "loop": {"position": "middle"},
            "data": {"builtin_max_bytes": 150_000, "tokenizer": {"vocab_size": 512}, "cache_dir": str(cache)},
            "train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 6, "warmup_steps": 2, "log_every": 3,
                      "eval_every": 3, "save_every": 6, "run_dir": str(run_dir), **train},
            "eval": {"eval_batches": 1}}


# ---------------------------------------------------------------------------------------------
# pure formatting
# ---------------------------------------------------------------------------------------------


def test_banner_states_layout_budgets_and_batch(tmp_path):
    cfg = config_from_dict(_raw(tmp_path / "run", tmp_path, gradient_accumulation_steps=3))
    b = compute_budget(cfg, cfg.train.seq_len)
    text = banner(cfg, run_dir="/runs/x", world=2, accum=3, budget=b, precision="fp32", device="cpu",
                  threads=ThreadChoice(1, "2 cores / 2 local ranks; OMP_NUM_THREADS unset"), start_step=3)
    lines = text.splitlines()
    assert lines[0] == "smelt-ds train: console" and 8 <= len(lines) <= 12
    rows = {ln[2:2 + LABEL_WIDTH].strip(): ln[2 + LABEL_WIDTH:] for ln in lines[1:]}
    assert all(ln[:2] == "  " and ln[2 + LABEL_WIDTH - 1] == " " and ln[2 + LABEL_WIDTH] != " " for ln in lines[1:])
    assert rows["run dir"] == "/runs/x (resumed at step 3)"
    assert rows["model"] == ("SMELT: layers [1, 3) x2 (block order, loop.position middle), 6 visits of 4 unique "
                             "layers")
    assert rows["layout"] == ("2 ranks: data-parallel 2, expert-parallel 1, MoE backend reference, ZeRO-0, fp32 "
                              "on cpu")
    # 2 samples x 32 tokens x 3 micro-batches x 2 data-parallel ranks
    assert rows["batch"] == "384 tokens/step = micro-batch 2 x seq_len 32 x accumulation 3 x data-parallel 2"
    assert rows["schedule"].startswith("6 steps = 2,304 tokens; lr 3.00e-03 cosine, warmup 2 steps")
    assert rows["budgets"] == (f"{b.forward_flops_per_token:,.0f} forward FLOPs/token | "
                               f"{b.non_embedding_params:,} non-embedding params | "
                               f"{b.kv_cache_bytes_per_token:,} KV-cache bytes/token (bf16)")
    # 512 x 32 embedding + 512 x 32 head (untied)
    assert b.embedding_params == 2 * 512 * 32
    assert rows["params"].startswith(f"{b.non_embedding_params + 32768:,} total = {b.non_embedding_params:,} "
                                     "non-embedding + 32,768 embedding/head")
    assert rows["threads"] == "1 per rank (2 cores / 2 local ranks; OMP_NUM_THREADS unset)"
    assert rows["deterministic"].startswith("off")


def test_step_and_val_lines():
    row = {"loss": 5.123449, "lr": 3e-4, "grad_norm": 1.2345, "tokens_per_s": 2345.4, "tflops_per_device": 0.0284,
           "memory_bytes": 1.5 * 2 ** 30, "mfu": 0.1234}
    assert step_line(10, 1000, row, eta_s=185) == (
        "step   10/1000 | loss 5.1234 | lr 3.00e-04 | grad_norm 1.234 | "
        "2,345 tok/s | 0.0284 TFLOP/s | MFU 12.3% | rss 1.50 GiB | eta 3m05s")
    no_mfu = {k: v for k, v in row.items() if k != "mfu"}
    assert step_line(1000, 1000, no_mfu, cuda=True).endswith("| 0.0284 TFLOP/s | mem 1.50 GiB")
    assert val_line(50, {"text": 5.0, "code": 4.1, "all": 4.55}) == (
        "val  step 50 | all 4.5500 | code 4.1000 | text 5.0000")
    assert [format_duration(s) for s in (0.4, 59, 61, 3599, 7620)] == ["0s", "59s", "1m01s", "59m59s", "2h07m"]


def test_interval_means_and_steady_throughput():
    acc = IntervalMeans()
    for loss, lm in ((3.0, 2.0), (5.0, 4.0), (10.0, 9.0)):
        acc.add({"loss": loss, "lm_loss": lm})
    assert acc.pop() == {"loss": 6.0, "lm_loss": 5.0, "loss_last_step": 10.0, "loss_steps": 3}
    with pytest.raises(ValueError):
        acc.pop()
    # first window 10 s for 1,000 tokens (compile), then 3,000 tokens in 1 s + 1,000 tokens in 1 s
    t = throughput([(1000, 10.0), (3000, 1.0), (1000, 1.0)])
    assert t == {"tokens_per_s": 2000.0, "first_window_s": 10.0, "startup_s": 9.5, "throughput_windows": 3}
    assert throughput([(1000, 4.0)]) == {"tokens_per_s": 250.0, "first_window_s": 4.0, "startup_s": None,
                                         "throughput_windows": 1}
    assert throughput([])["tokens_per_s"] is None


def test_summary_block():
    s = {"name": "r", "steps": 100, "tokens": 102400, "tokens_per_s": 4321.0, "throughput_windows": 4,
         "first_window_s": 12.25, "startup_s": 10.0, "final_train_loss": 4.5, "final_lm_loss": 4.25,
         "final_loss_steps": 25, "validation_loss": {"text": 5.0, "code": 4.0, "all": 4.5},
         "unigram_entropy_nats": 6.7, "budget": {"forward_flops_per_token": 1e6, "non_embedding_params": 1234,
                                                 "kv_cache_bytes_per_token": 3072, "kv_dtype": "bf16", "visits": 6,
                                                 "unique_layers": 4}}
    lines = summary_lines(s, "domains weighted equally", "/runs/r")
    assert lines[0] == "summary: r, 100 steps, 102,400 tokens"
    text = "\n".join(lines)
    assert ("4,321 tokens/s steady state (3 logged windows after the first); first window 12.2 s, 10.0 s of it "
            "start-up") in text
    assert "4.5000 (LM 4.2500), mean over the last 25 steps" in text
    assert [ln.split()[1] for ln in lines if ln.startswith("  val [")] == ["[all]", "[code]", "[text]"]
    assert "4.5000 nats/token (domains weighted equally)" in text


def test_console_bar_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    plain = io.StringIO()
    c = Console(True, 0, 5, stream=plain)
    c.start_bar()
    c.advance(1.0)
    c.line("step 1/5 | loss 1.0000")
    c.close()
    assert c.bar is None and plain.getvalue() == "step 1/5 | loss 1.0000\n"   # no bar in a log file
    tty = Tty()
    c = Console(True, 0, 5, stream=tty)
    c.start_bar()
    assert c.bar is not None
    c.advance(2.5)
    c.line("step 1/5 | loss 2.5000")
    c.close()
    assert "step 1/5 | loss 2.5000\n" in tty.getvalue() and "loss=2.500" in tty.getvalue()
    quiet = io.StringIO()
    c = Console(False, 0, 5, stream=quiet)  # ranks other than 0
    c.line("x")
    assert quiet.getvalue() == ""


# ---------------------------------------------------------------------------------------------
# two deterministic runs: interval means, throughput, bit-identical reruns
# ---------------------------------------------------------------------------------------------


def _train(rank, world, raw):
    from smelt_ds.train.loop import train

    r = train(config_from_dict(raw))
    return {"losses": r.losses, "val": r.val, "windows": r.windows}


@pytest.fixture(scope="module")
def det_runs(tmp_path_factory):
    """Two identical 6-step runs with ``train.deterministic: true``, ``log_every: 3``, side by side
    (one single-threaded process each), on data prepared once."""
    from smelt_ds.data.prepare import prepare_from_config

    tmp = tmp_path_factory.mktemp("console")
    cache = tmp_path_factory.getbasetemp() / "shared-smelt-cache"  # also used by tests/parallel/test_threads.py
    raws = [_raw(tmp / f"run{i}", cache, deterministic=True) for i in range(2)]
    prepare_from_config(config_from_dict(raws[0]).data)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda raw: run_distributed(_train, 1, args=(raw,), timeout=300)[0], raws))
    return raws, results


@pytest.mark.slow
def test_deterministic_reruns_are_bit_identical(det_runs):
    _, (a, b) = det_runs
    assert len(a["losses"]) == 6
    assert a["losses"] == b["losses"]            # ==, not approx
    assert a["val"] == b["val"] and set(a["val"]) == {"code", "text", "all"}


@pytest.mark.slow
def test_logged_loss_is_the_interval_mean_and_summary_excludes_the_first_window(det_runs):
    raws, (a, _) = det_runs
    run_dir = Path(raws[0]["train"]["run_dir"])
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r}
    assert sorted(rows) == [3, 6]
    losses = a["losses"]
    assert rows[6]["loss"] == pytest.approx(sum(losses[3:6]) / 3, rel=0, abs=1e-9)
    assert rows[3]["loss"] == pytest.approx(sum(losses[0:3]) / 3, rel=0, abs=1e-9)
    assert rows[6]["loss_last_step"] == losses[5] and rows[3]["loss_last_step"] == losses[2]
    assert rows[6]["loss_steps"] == 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_train_loss"] == rows[6]["loss"] and summary["final_loss_steps"] == 3
    # two windows of 3 steps x 64 tokens: the summary's rate is the second window's, as logged
    assert [t for t, _ in a["windows"]] == [192, 192]
    assert summary["tokens_per_s"] == pytest.approx(rows[6]["tokens_per_s"], rel=1e-9)
    assert summary["first_window_s"] == pytest.approx(192 / rows[3]["tokens_per_s"], rel=1e-9)
    assert summary["throughput_windows"] == 2
    assert summary["threads"]["torch_threads"] == 1
    assert summary["threads"]["reason"].startswith("train.deterministic")
    text = (run_dir / "summary.txt").read_text()
    assert f"{rows[6]['loss']:.4f} (LM {rows[6]['lm_loss']:.4f}), mean over the last 3 steps" in text
