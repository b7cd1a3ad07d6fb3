"""``bench/gpu_check.py --dry-run``: the one-GPU script, run on CPU at tiny sizes (CI).

One dry run of every section is shared by most tests here (module fixture). Each test checks the
JSON against something computed here, independently of the script: the files the numbers come
from (``artifacts/``: the runs' ``metrics.jsonl``, ``eval.json``, the generated ids, each memory
process's report), the budget arithmetic of one layer written out from its formula, the analytic
activation bytes (``activation_bytes``), and the text table parsed back.

Tolerances: arithmetic identities 1e-9 relative; values printed with 4 significant digits 1e-3
relative. Two fp32 computations of the same training loss in other summation orders (2 ranks
against 1, a resumed run against an uninterrupted one, ``smelt-ds eval`` against the in-loop
validation) within Higham & Mary's probabilistic bound over the chain of reductions that produced
it (:func:`tests.numerics.prob_tol` of :func:`tests.numerics.lm_chain_length` per step, times the
step for a training step, which carries every earlier step's chains: tests/runs/test_reshard.py).

Failure handling: ``--fail-section NAME[:MODE]`` (a test-only hook) makes a section raise, exit
without a result or hang; the run must record it and go on, and a run killed mid-way must leave
the sections it finished in a valid JSON. The 2-rank fallback (a configuration whose process group
lacks an operation is followed by the next) and the GPU plan's sections (their sizes, flags and
branches, and the table of a GPU run) run here with the commands replaced: no GPU is needed.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from smelt_ds.config.loading import load_config
from smelt_ds.parallel.memory import activation_bytes
from smelt_ds.testing.distributed import scaled_timeout, timeout_scale
from tests.markers import slow_fixture
from tests.numerics import lm_chain_length, prob_tol

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
SECTIONS = ["sdpa", "tiny_journey", "two_ranks_one_gpu", "memory", "mfu_layer"]
TINY = ROOT / "recipes" / "tiny" / "smelt.yaml"
#: the dry run's sizes (bench/gpu_check.py make_plan), restated: the tests check the script against them
DRY_DATA = ["data.builtin_max_bytes=150000", "data.tokenizer.vocab_size=512", "model.vocab_size=512"]
JOURNEY_STEPS, JOURNEY_STOP, NEW_TOKENS = 12, 6, 16
TWO_RANK_STEPS, GLOBAL_TOKENS = 4, 256
PRINTED = 1e-3  # a value printed with 4 significant digits


def _script():
    """bench/gpu_check.py as a module (for the tests that call its functions in this process)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(extra)
    return env


def _run(args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=str(ROOT),
                          env=_env(**env), timeout=scaled_timeout(timeout))


def _budget(seconds: float) -> str:
    return str(seconds * timeout_scale())


@pytest.fixture(scope="module")
@slow_fixture
def dry(tmp_path_factory):
    """One full dry run: ``(process, out_dir, json, text)``."""
    out = tmp_path_factory.mktemp("gpu_check")
    proc = _run(["--dry-run", "--out", str(out), "--budget-s", _budget(420)], timeout=600)
    data = json.loads((out / "gpu_check.json").read_text())
    return proc, out, data, (out / "gpu_check.txt").read_text()


def _result(data: dict, name: str) -> dict:
    rec = data["sections"][name]
    assert rec["status"] == "ok", f"{name}: {rec.get('error')}"
    return rec["result"]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(path) if "loss" in r}


def test_dry_run_runs_every_section(dry):
    proc, _, data, _ = dry
    assert list(data["sections"]) == SECTIONS
    bad = {n: r.get("error", r) for n, r in data["sections"].items() if r["status"] != "ok"}
    assert not bad, bad
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert data["dry_run"] is True and data["device"] == "cpu"
    assert data["finished_utc"] is not None


def test_machine_info(dry):
    m = dry[2]["machine"]
    assert m["torch"] == torch.__version__
    assert m["cuda_version"] == torch.version.cuda
    when = datetime.datetime.fromisoformat(m["date_utc"])
    assert abs((datetime.datetime.now(datetime.UTC) - when).total_seconds()) < 3 * 3600
    assert m["device_used"] == "cpu (dry run)"
    assert m["missing_modules"] == []


def test_journey_stops_resumes_and_logs_each_step_once(dry):
    _, out, data, _ = dry
    r = _result(data, "tiny_journey")
    assert {k: c["rc"] for k, c in r["commands"].items()} == {
        "train_stop": 0, "generate_help": 0, "train_resume": 0, "train_uninterrupted": 0, "export": 0, "eval": 0,
        "generate": 0}
    assert (r["steps"], r["stopped_at"]) == (JOURNEY_STEPS, JOURNEY_STOP)
    assert r["steps_before_resume"] == list(range(1, JOURNEY_STOP + 1))  # the first leg stopped where it was told
    stop_cmd = r["commands"]["train_stop"]["argv"]
    assert f"train.exit_after_steps={JOURNEY_STOP}" in stop_cmd
    assert r["commands"]["train_resume"]["argv"][-2:] == ["--resume", "auto"]
    assert "train.precision=fp32" in stop_cmd and "--device" in r["commands"]["eval"]["argv"]
    # the resumed run's metrics.jsonl, read here: every step once, in order
    rows = _rows(out / r["artifacts"]["resumed_metrics"])
    steps = [row["step"] for row in rows if "loss" in row]
    assert steps == list(range(1, JOURNEY_STEPS + 1))
    assert r["each_step_once"] is True and r["steps_logged"] == steps
    resumed = _losses(out / r["artifacts"]["resumed_metrics"])
    full = _losses(out / r["artifacts"]["uninterrupted_metrics"])
    assert sorted(full) == list(range(1, JOURNEY_STEPS + 1))
    assert r["losses"]["resumed"] == [resumed[s] for s in range(1, JOURNEY_STEPS + 1)]
    # the resumed steps continue the uninterrupted trajectory: the same sums, at most in other orders
    cfg = load_config(TINY, r["overrides"])
    n_step = lm_chain_length(cfg, cfg.train.micro_batch_size * cfg.train.seq_len)
    for s in range(1, JOURNEY_STEPS + 1):
        assert abs(resumed[s] - full[s]) <= prob_tol(s * n_step) * abs(full[s]), (s, resumed[s], full[s])
    worst = max(abs(resumed[s] - full[s]) / abs(full[s]) for s in range(JOURNEY_STOP + 1, JOURNEY_STEPS + 1))
    assert r["resumed_vs_uninterrupted"]["max_rel_diff_after_stop"] == pytest.approx(worst, rel=1e-9, abs=1e-15)


def test_journey_eval_equals_the_training_validation(dry):
    _, out, data, _ = dry
    r = _result(data, "tiny_journey")
    ev = json.loads((out / r["artifacts"]["eval"]).read_text())
    name = ev["runs"][0]["name"]
    assert r["eval"]["device"] == "cpu" and r["eval"]["run"] == name
    val = [row for row in _rows(out / r["artifacts"]["resumed_metrics"]) if "val/all" in row][-1]
    assert val["step"] == JOURNEY_STEPS
    # --training-windows: the same windows as the in-loop validation, the same weights (the last step's)
    cfg = load_config(TINY, r["overrides"])
    tol = prob_tol(lm_chain_length(cfg, 0, backward=False))
    for dom in ("code", "text", "all"):
        got = ev["domains"][name][dom]["loss"]
        assert r["eval"]["domains"][dom]["loss"] == got
        assert abs(got - val[f"val/{dom}"]) <= tol * val[f"val/{dom}"], (dom, got, val[f"val/{dom}"], tol)
    assert r["eval"]["loss_rel_diff_to_training_val"] == pytest.approx(
        abs(ev["domains"][name]["all"]["loss"] - val["val/all"]) / val["val/all"], rel=1e-9, abs=1e-15)


def test_journey_generates_from_the_export(dry):
    _, out, data, _ = dry
    g = _result(data, "tiny_journey")["generate"]
    (gen,) = json.loads((out / _result(data, "tiny_journey")["artifacts"]["generate"]).read_text())
    assert gen["mode"] == "greedy"
    assert gen["new_tokens"] == NEW_TOKENS == g["new_tokens"]  # --no-stop: exactly as many as asked
    assert len(gen["ids"]) == gen["prompt_tokens"] + NEW_TOKENS
    assert g["text_chars"] == len(gen["text"]) > 0
    assert "export" in _result(data, "tiny_journey")["commands"]["generate"]["argv"][4]


def test_two_ranks_losses_match_one_rank(dry):
    _, out, data, _ = dry
    r = _result(data, "two_ranks_one_gpu")
    assert r["configuration"] == "autoep_ep2_zero3"  # gloo on the CPU has every operation: the first choice runs
    (attempt,) = r["attempts"]
    assert attempt["ok"] and {k: c["rc"] for k, c in attempt["ranks"].items()} == {"rank0": 0, "rank1": 0}
    assert "gloo" in r["dist_backend"]
    two = _losses(out / r["artifacts"]["two_ranks_metrics"])
    one = _losses(out / r["artifacts"]["one_rank_metrics"])
    assert sorted(two) == sorted(one) == list(range(1, TWO_RANK_STEPS + 1))
    cfg = load_config(TINY, [*r["overrides"], *attempt["overrides"]])
    assert (cfg.moe_runtime.backend, cfg.moe_runtime.ep_size, cfg.deepspeed.zero_stage) == ("autoep", 2, 3)
    assert cfg.train.global_batch_tokens == GLOBAL_TOKENS
    n_step = lm_chain_length(cfg, GLOBAL_TOKENS)
    for s in range(1, TWO_RANK_STEPS + 1):
        tol = prob_tol(s * n_step)
        assert abs(two[s] - one[s]) <= tol * abs(one[s]), (s, two[s], one[s], tol)
        row = r["losses"][s - 1]
        assert (row["step"], row["two_ranks"], row["one_rank"]) == (s, two[s], one[s])
        assert row["fp32_bound"] == pytest.approx(tol, rel=1e-12)
    assert r["within_fp32_bound"] is True
    assert r["max_rel_diff"] == pytest.approx(max(abs(two[s] - one[s]) / one[s] for s in two), rel=1e-9, abs=1e-15)


def test_memory_measures_one_policy_per_process(dry):
    _, out, data, _ = dry
    r = _result(data, "memory")
    assert list(r["policies"]) == ["none", "looped", "full"]
    pids = [p["pid"] for p in r["policies"].values()]
    assert len(set(pids)) == 3 and r["section_pid"] not in pids
    cfg = load_config(TINY, ["train.micro_batch_size=2", "train.seq_len=32"])
    predicted = {}
    for policy, row in r["policies"].items():
        report = json.loads((out / row["artifact"]).read_text())
        (m,) = report["measured"]
        assert m["policy"] == policy and m["device"] == "cpu"
        predicted[policy] = activation_bytes(cfg, policy, 2, 32, 4, "cpu").stored  # fp32 on CPU
        assert row["estimate_bytes"] == predicted[policy] == m["predicted_activations"]
        assert row["measured_bytes"] == m["saved_activations"]
        assert row["ratio"] == pytest.approx(row["measured_bytes"] / predicted[policy], rel=1e-12)
        assert row["ratio_note"].startswith("not a measurement")
        # the quantity counted is the saved activations (parameters would be over twice as large)
        assert 0.5 < row["ratio"] < 2
    assert predicted["full"] < predicted["looped"] < predicted["none"]  # each policy measured its own setting


def test_layer_flops_follow_the_budget_arithmetic(dry):
    r = _result(dry[2], "mfu_layer")
    cfg = load_config(TINY)
    m, moe = cfg.model, cfg.moe
    H, Nq, Nkv, D = m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim
    E, K, F = moe.num_experts, moe.top_k, moe.expert_ffn_size
    B, S = 2, 32
    assert r["shape"] == {"hidden": H, "heads": Nq, "kv_heads": Nkv, "head_dim": D, "experts": E, "top_k": K,
                          "expert_ffn": F, "batch": B, "seq_len": S, "vocab": m.vocab_size}

    def forward(n_keys: float) -> float:  # q, o, k, v projections; q k^T and p v; router; top-k SwiGLU experts
        return 2 * (2 * H * Nq * D + 2 * H * Nkv * D) + 2 * 2 * n_keys * Nq * D + 2 * H * E + K * 6 * H * F

    assert r["forward_flops_per_token"] == forward(S)
    assert r["train_flops_per_token"] == 3 * forward(S)
    assert r["train_flops_per_token_causal"] == pytest.approx(3 * forward((S + 1) / 2), rel=1e-12)
    assert r["tokens"] == B * S
    assert len(r["times_s"]) == 3 and r["warmup"] == 1
    assert r["median_s"] == statistics.median(r["times_s"])
    assert r["tflops_per_s"] == pytest.approx(B * S * 3 * forward(S) / r["median_s"] / 1e12, rel=1e-9)
    assert r["tflops_per_s_causal"] == pytest.approx(B * S * 3 * forward((S + 1) / 2) / r["median_s"] / 1e12,
                                                     rel=1e-9)
    assert r["mfu"] is None and r["mfu_causal"] is None and r["peak_tflops"] is None  # no MFU on CPU
    assert r["mfu_note"].startswith("n/a")


def test_sdpa_backends(dry):
    r = _result(dry[2], "sdpa")
    cfg = load_config(TINY)
    assert r["shape"]["batch"] == 2 and r["shape"]["seq_len"] == 32
    assert (r["shape"]["heads"], r["shape"]["head_dim"]) == (cfg.model.num_heads, cfg.model.resolved_head_dim)
    assert set(r["forced"]) == {"flash", "efficient", "cudnn", "math"}
    assert r["forced"]["math"]["ok"]  # the math kernel runs anywhere
    assert r["available"] == [b for b, f in r["forced"].items() if f["ok"]]
    assert r["default_backend"] in r["available"]  # what the default picks must run when forced
    assert r["default_aten_ops"] and all(o.startswith("aten::_scaled_dot_product") for o in r["default_aten_ops"])
    for f in r["forced"].values():
        assert f["ok"] == ("fwd_bwd_ms" in f) and f["ok"] != ("error" in f)


def _table(text: str) -> dict[tuple[str, str], tuple[str, str]]:
    """The one table of gpu_check.txt: ``(section, item) -> (value, note)``. Read here without the
    script's parser: the header line starts with ``section  item  value  note``, a line of dashes
    follows, rows run to a blank line; cells are separated by two or more spaces."""
    lines = text.splitlines()
    (head,) = [i for i, line in enumerate(lines) if re.match(r"section\s{2,}item\s{2,}value\s{2,}note$", line)]
    assert set(lines[head + 1]) == {"-"}
    table = {}
    for line in lines[head + 2:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip(), maxsplit=3) + [""]
        assert (cells[0], cells[1]) not in table, line
        table[(cells[0], cells[1])] = (cells[2], cells[3])
    return table


def _num(cell: str) -> float:
    return float(cell)


def test_text_table_lists_the_json_values(dry):
    _, _, data, text = dry
    t = _table(text)
    assert "DRY RUN" in text and "not measurements" in text
    for name, rec in data["sections"].items():
        assert t[(name, "status")][0] == rec["status"]
        assert _num(t[(name, "elapsed_s")][0]) == pytest.approx(rec["elapsed_s"], rel=PRINTED)
    j = _result(data, "tiny_journey")
    for key, c in j["commands"].items():
        assert int(t[("tiny_journey", f"{key}.exit_status")][0]) == c["rc"]
    assert t[("tiny_journey", "each_step_once")][0] == "yes"
    for dom, v in j["eval"]["domains"].items():
        assert _num(t[("tiny_journey", f"eval.{dom}.loss")][0]) == pytest.approx(v["loss"], rel=PRINTED)
    assert int(t[("tiny_journey", "generated_tokens")][0]) == j["generate"]["new_tokens"]
    assert int(t[("tiny_journey", "generated_chars")][0]) == j["generate"]["text_chars"]
    two = _result(data, "two_ranks_one_gpu")
    assert t[("two_ranks_one_gpu", "configuration")][0] == two["configuration"]
    assert _num(t[("two_ranks_one_gpu", "max_rel_loss_diff")][0]) == pytest.approx(two["max_rel_diff"], rel=PRINTED)
    assert t[("two_ranks_one_gpu", "within_fp32_bound")][0] == "yes"
    for policy, row in _result(data, "memory")["policies"].items():
        assert int(t[("memory", f"{policy}.estimate_bytes")][0]) == row["estimate_bytes"]
        assert int(t[("memory", f"{policy}.measured_bytes")][0]) == row["measured_bytes"]
        value, note = t[("memory", f"{policy}.ratio")]
        assert _num(value) == pytest.approx(row["ratio"], rel=PRINTED) and note.startswith("not a measurement")
    mfu = _result(data, "mfu_layer")
    assert int(t[("mfu_layer", "tokens")][0]) == mfu["tokens"]
    for item, key in (("train_flops_per_token", "train_flops_per_token"), ("tflops_per_s", "tflops_per_s"),
                      ("tflops_per_s_causal", "tflops_per_s_causal")):
        assert _num(t[("mfu_layer", item)][0]) == pytest.approx(mfu[key], rel=PRINTED), item
    assert _num(t[("mfu_layer", "median_ms")][0]) == pytest.approx(mfu["median_s"] * 1e3, rel=PRINTED)
    assert t[("mfu_layer", "mfu")][0] == "n/a"
    sdpa = _result(data, "sdpa")
    assert t[("sdpa", "default_backend")][0] == sdpa["default_backend"]
    assert _num(t[("sdpa", "math.fwd_bwd_ms")][0]) == pytest.approx(sdpa["forced"]["math"]["fwd_bwd_ms"], rel=PRINTED)
    assert _script().parse_table(text) == [(s, i, v, n) for (s, i), (v, n) in t.items()]


def test_out_dir_holds_only_the_outputs(dry):
    out = dry[1]
    assert {p.name for p in out.iterdir()} == {"gpu_check.json", "gpu_check.txt", "logs", "artifacts"}
    assert {p.name for p in (out / "logs").iterdir()} == {f"{s}.log" for s in SECTIONS}
    assert {p.name for p in (out / "artifacts").iterdir()} == {"tiny_journey", "two_ranks_one_gpu", "memory"}
    assert not [p for p in out.rglob("*") if "tmp" in p.name]
    assert not list(Path(dry[2]["plan"]["work"]).parent.glob(Path(dry[2]["plan"]["work"]).name))  # work removed


def test_failure_line_names_the_missing_operation():
    gc = _script()
    texts = {"rank0": "[WARNING] [real_accelerator.py] async_io: not supported on this device\n"
                      "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                      "RuntimeError: ProcessGroupGloo::reduce_scatter: unsupported device type cuda\n",
             "rank1": "RuntimeError: gloo: the peer closed the connection, device cuda not supported\n"}
    assert gc._failure_line(texts) == ("RuntimeError: ProcessGroupGloo::reduce_scatter: unsupported device type cuda",
                                       True)  # rank 0's exception: the cause, not rank 1's consequence nor a warning
    assert gc._failure_line({"rank0": "ValueError: bad\n", "rank1": "ok\n"}) == ("ValueError: bad", False)
    assert gc._failure_line({"rank0": "", "rank1": ""}) == (None, False)
    assert gc._failure_line({"rank0": "[W] ProcessGroupGloo::alltoall_base: unsupported device type cuda\n"}) == (
        "[W] ProcessGroupGloo::alltoall_base: unsupported device type cuda", True)


def test_two_rank_fallback_after_a_missing_operation(tmp_path, monkeypatch):
    """The section with its commands replaced: AutoEP at ZeRO-3 fails on both ranks with a gloo
    message, the next configuration (AutoEP at ZeRO-2) runs; the JSON says which and why."""
    gc = _script()
    calls: list[dict] = []

    def fake(plan, cmds, share=1.0, linked=()):
        calls.append(cmds)
        recs, texts = {}, {}
        for key, (argv, _) in cmds.items():
            fail = key.startswith("rank") and "deepspeed.zero_stage=3" in argv and "moe_runtime.backend=autoep" in argv
            run = Path(argv[argv.index("--run-dir") + 1])
            run.mkdir(parents=True, exist_ok=True)
            if not fail:
                (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 6.0 - s / 10}) + "\n"
                                                           for s in range(1, TWO_RANK_STEPS + 1)))
            recs[key] = {"argv": argv, "rc": 1 if fail else 0, "elapsed_s": 1.0, "pid": 1}
            texts[key] = "RuntimeError: ProcessGroupGloo::alltoall_base: unsupported device type cuda\n" if fail else ""
        return recs, texts

    monkeypatch.setattr(gc, "run_commands", fake)
    plan = gc.make_plan(gc.parse_args(["--dry-run"]))
    plan.update({"work": str(tmp_path), "cache_dir": str(tmp_path / "cache"), "section": "two_ranks_one_gpu",
                 "section_work": str(tmp_path), "out_dir": str(tmp_path / "out"), "deadline": time.time() + 60,
                 "result_path": str(tmp_path / "result.json")})
    r = gc.section_two_ranks_one_gpu(plan)
    assert [set(c) for c in calls] == [{"rank0", "rank1", "one_rank"}, {"rank0", "rank1"}]
    assert r["configuration"] == "autoep_ep2_zero2"
    first = r["attempts"][0]
    assert first["config"] == "autoep_ep2_zero3" and not first["ok"] and first["process_group_lacks_an_operation"]
    assert r["why"].startswith("autoep_ep2_zero3 failed (the process group lacks an operation): RuntimeError: "
                               "ProcessGroupGloo::alltoall_base")
    assert r["max_rel_diff"] == 0 and r["within_fp32_bound"] is True
    for r_ in (0, 1):  # the ranks as the launcher would start them, both on local rank 0; plain gloo on a dry run
        env = calls[1][f"rank{r_}"][1]
        assert env == {"RANK": str(r_), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": env["MASTER_PORT"]}
    gpu = gc._two_rank_cmds(plan, "r.yaml", [], tmp_path, 1234, "cuda:gloo")
    assert gpu["rank1"][1]["SMELT_DIST_BACKEND"] == "cuda:gloo" and gpu["rank1"][1]["LOCAL_RANK"] == "0"
    assert gc.make_plan(gc.parse_args([]))["two_ranks"]["backend"] == "cuda:gloo"


def _fake_gpu_commands(plan, cmds, share=1.0, linked=()):
    """``run_commands`` for the GPU plan without a GPU: each command leaves what the real one would
    (a run's ``metrics.jsonl``, ``eval.json``, printed JSON), and exit status 0."""
    recs, texts = {}, {}
    for key, (argv, env) in cmds.items():
        text = ""
        value = {a.split("=")[0]: a.split("=", 1)[1] for a in argv if "=" in a}
        if ("train" in argv or "smelt_ds.train" in argv) and env.get("RANK") != "1":  # rank 0 writes the metrics
            run, steps = Path(argv[argv.index("--run-dir") + 1]), int(value["train.max_steps"])
            run.mkdir(parents=True, exist_ok=True)
            first = len(_losses(run / "metrics.jsonl")) + 1 if "--resume" in argv else 1
            last = int(value.get("train.exit_after_steps", steps))
            rows = [{"step": s, "loss": 6.0 - s / 100} for s in range(first, last + 1)]
            rows += [{"step": steps, "val/all": 4.5, "val/code": 4.0, "val/text": 5.0}] if last == steps else []
            with open(run / "metrics.jsonl", "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        elif "eval" in argv:
            out = Path(argv[argv.index("-o") + 1])
            out.mkdir(parents=True)
            shift = 1.001 if argv[argv.index("--device") + 1] == "cuda" else 1.0
            (out / "eval.json").write_text(json.dumps({"runs": [{"name": "tiny-smelt"}], "domains": {"tiny-smelt": {
                d: {"loss": v * shift, "bits_per_byte": 1.0, "windows": 8, "tokens": 1024}
                for d, v in (("code", 4.0), ("text", 5.0), ("all", 4.5))}}}))
        elif "--help" in argv:
            text = "usage: smelt-ds generate RUN [--device DEVICE]\n"
        elif "generate" in argv:
            n = int(argv[argv.index("--max-new-tokens") + 1])
            text = "loading\n" + json.dumps([{"mode": "greedy", "prompt_tokens": 3, "new_tokens": n, "text": "x" * n,
                                               "tokens_per_s": 100.0, "ids": list(range(3 + n))}], indent=1) + "\n"
        elif "memory" in argv:
            policy = argv[argv.index("--policies") + 1]
            peak = {"none": 9, "looped": 8, "full": 7}[policy] * 2**30
            text = json.dumps({"measured": [{"policy": policy, "device": "cuda", "peak_allocated": peak,
                                             "predicted_total": 10 * 2**30, "predicted_activations": 1,
                                             "saved_activations": None}]}, indent=2) + "\n"
        recs[key] = {"argv": argv, "rc": 0, "timed_out": False, "elapsed_s": 1.0, "pid": 1000 + len(texts),
                     "env": env}
        texts[key] = text
    return recs, texts


def test_gpu_plan_with_the_commands_replaced(tmp_path, monkeypatch):
    """The sections that run commands, planned for a GPU (no GPU here: the commands are replaced),
    and the table of their results: the GPU's sizes, flags and branches that a dry run does not take."""
    gc = _script()
    monkeypatch.setattr(gc, "run_commands", _fake_gpu_commands)
    plan = gc.make_plan(gc.parse_args([]))
    assert (plan["device"], plan["dtype"], plan["precision"]) == ("cuda", "bfloat16", "bf16")
    results = {}
    for name, fn in (("tiny_journey", gc.section_tiny_journey), ("two_ranks_one_gpu", gc.section_two_ranks_one_gpu),
                     ("memory", gc.section_memory)):
        work = tmp_path / name
        work.mkdir()
        plan.update({"work": str(tmp_path), "cache_dir": str(tmp_path / "cache"), "section": name,
                     "section_work": str(work), "out_dir": str(tmp_path / "out"), "deadline": time.time() + 60,
                     "result_path": str(work / "result.json")})
        results[name] = fn(plan)
    j = results["tiny_journey"]
    assert (j["steps"], j["stopped_at"], j["each_step_once"]) == (200, 120, True)
    assert "train.precision=bf16" in j["commands"]["train_stop"]["argv"]
    assert j["commands"]["eval"]["argv"][j["commands"]["eval"]["argv"].index("--device") + 1] == "cuda"
    assert j["commands"]["eval"]["argv"][4].endswith("tiny_journey/run")  # the run directory, beside the export
    assert j["commands"]["eval_cpu"]["argv"][4].endswith("tiny_journey/export")  # then the export, on the CPU
    cpu_argv = " ".join(j["commands"]["eval_cpu"]["argv"])
    assert "--device cpu --dtype float32 --training-windows" in cpu_argv
    assert j["eval"]["cpu_float32"]["loss_rel_diff"]["all"] == pytest.approx(1e-3, rel=1e-9)
    assert "--device cuda" in " ".join(j["commands"]["generate"]["argv"]) and j["generate"]["new_tokens"] == 64
    t = results["two_ranks_one_gpu"]
    assert t["configuration"] == "autoep_ep2_zero3" and t["steps"] == 20 and t["within_fp32_bound"] is True
    assert t["attempts"][0]["ranks"]["rank1"]["env"]["SMELT_DIST_BACKEND"] == "cuda:gloo"
    assert "SMELT_DIST_BACKEND" not in t["one_rank"]["command"]["env"]
    m = results["memory"]
    assert "--micro-batch" in m["policies"]["none"]["command"]["argv"]
    assert {p: r["ratio"] for p, r in m["policies"].items()} == {"none": 0.9, "looped": 0.8, "full": 0.7}
    assert not any("ratio_note" in r for r in m["policies"].values())
    # the GPU's recipes load at the planned sizes; one layer of recipe s, as the budget counts it
    layer = gc._layer_config(plan)
    assert (layer.train.micro_batch_size, layer.train.seq_len, layer.moe.num_experts) == (4, 4096, 94)
    assert gc.layer_forward_flops(layer) == 2 * 4 * 1024 * 1024 + 4 * 4096 * 1024 + 2 * 1024 * 94 + 8 * 6 * 1024 * 448
    small = load_config(ROOT / plan["memory"]["recipe"], plan["memory"]["sets"])
    assert (small.model.num_layers, small.schedule.effective_depth, small.moe.num_experts) == (4, 6, 16)
    # the table of a GPU run
    mfu = gc.section_mfu_layer({**gc.make_plan(gc.parse_args(["--dry-run"])), "result_path": str(tmp_path / "m.json")})
    mfu.update({"peak_tflops": 989.0, "mfu": 0.4, "mfu_causal": 0.3, "mfu_note": None, "device_name": "H100"})
    state = {"dry_run": False, "sections": {n: {"status": "ok", "elapsed_s": 1.0, "budget_s": 100.0, "result": r}
                                            for n, r in {**results, "mfu_layer": mfu}.items()},
             "machine": {"date_utc": "2026-12-07T00:00:00+00:00", "device_name": "NVIDIA H100 80GB HBM3",
                         "capability": [9, 0], "gpu_memory_bytes": 80 * 2**30, "bf16_supported": True,
                         "torch": "2.13.0", "cuda_version": "12.8", "packages": {"deepspeed": "0.19.8"},
                         "python": "3.11", "cpu_count": 16, "missing_modules": []}}
    text = gc.render_text(state)
    assert "DRY RUN" not in text and "NVIDIA H100 80GB HBM3 (sm_90, 80.0 GiB" in text
    table = _table(text)
    assert table[("tiny_journey", "eval.all.rel_diff_to_cpu_float32")][0] == "0.001"
    assert table[("memory", "none.ratio")] == ("0.9", "measured / estimate")
    assert table[("mfu_layer", "mfu")] == ("0.4", "dense bf16 peak 989 TFLOP/s")
    assert table[("two_ranks_one_gpu", "configuration")][0] == "autoep_ep2_zero3"
    # a section that stopped part-way: the table lists what it had done
    failed = {"commands": {"train_stop": {**j["commands"]["train_stop"], "rc": 1}},
              "attempts": [{**t["attempts"][0], "ok": False, "failure_line": "RuntimeError: boom"}]}
    state["sections"] = {"tiny_journey": {"status": "failed", "elapsed_s": 2.0, "budget_s": 100.0, "partial": failed,
                                          "error": {"type": "RuntimeError", "message": "commands failed"}}}
    table = _table(gc.render_text(state))
    assert table[("tiny_journey", "error")] == ("RuntimeError", "commands failed")
    assert table[("tiny_journey", "train_stop.exit_status")][0] == "1"
    assert table[("tiny_journey", "attempt.autoep_ep2_zero3")] == ("failed", "RuntimeError: boom")


@pytest.mark.slow
def test_linked_commands_end_together(tmp_path, monkeypatch):
    gc = _script()
    monkeypatch.setattr(gc, "LINKED_GRACE_S", 1.0)
    plan = {"work": str(tmp_path), "section_work": str(tmp_path), "deadline": time.time() + 120, "dry_run": True}
    t0 = time.time()
    recs, _ = gc.run_commands(plan, {"rank0": ([sys.executable, "-c", "import sys; sys.exit(4)"], {}),
                                     "rank1": ([sys.executable, "-c", "import time; time.sleep(100)"], {}),
                                     "other": ([sys.executable, "-c", "print('done')"], {})},
                              linked=("rank0", "rank1"))
    assert time.time() - t0 < scaled_timeout(30)  # rank1 was killed 1 s after rank0 failed, not after 100 s
    assert (recs["rank0"]["rc"], recs["rank1"]["rc"], recs["other"]["rc"]) == (4, None, 0)
    assert recs["rank1"]["timed_out"] and (tmp_path / "other.log").read_text() == "done\n"


@pytest.mark.slow
def test_section_failures_are_recorded_and_the_run_goes_on(tmp_path):
    # the hanging section waits out its share of the budget: 53 s x 0.05 / 0.44 = 6 s (above
    # MIN_SECTION_S; not multiplied by the timeout scale, which would only make the test wait longer),
    # the raising one fails at once, and the last one (about 5 s here, 3x that on a loaded machine)
    # gets the rest
    proc = _run(["--dry-run", "--out", str(tmp_path), "--sections", "sdpa,tiny_journey,mfu_layer", "--budget-s", "53",
                 "--fail-section", "sdpa:hang", "--fail-section", "tiny_journey"], timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(data["sections"]) == ["sdpa", "tiny_journey", "mfu_layer"]
    hung, raised, ok = (data["sections"][n] for n in ("sdpa", "tiny_journey", "mfu_layer"))
    assert hung["status"] == "timeout" and "ran past" in hung["error"]["message"]
    assert hung["elapsed_s"] == pytest.approx(hung["budget_s"], abs=scaled_timeout(10))
    assert raised["status"] == "failed" and raised["error"]["type"] == "RuntimeError"
    assert "forced failure of section 'tiny_journey'" in raised["error"]["message"]
    assert "_forced_failure" in raised["error"]["traceback_tail"]
    assert ok["status"] == "ok" and ok["result"]["median_s"] > 0
    assert data["summary"]["sections_not_ok"] == ["sdpa", "tiny_journey"]
    text = (tmp_path / "gpu_check.txt").read_text()
    assert "forced failure of section 'tiny_journey'" in text and "timeout" in text


@pytest.mark.slow
def test_a_section_that_dies_is_recorded(tmp_path):
    proc = _run(["--dry-run", "--out", str(tmp_path), "--sections", "sdpa", "--fail-section", "sdpa:exit"],
                timeout=120)
    assert proc.returncode == 1
    rec = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["sdpa"]
    assert rec["status"] == "failed" and rec["error"]["type"] == "ChildExit"
    assert "exited with status 3" in rec["error"]["message"]


@pytest.mark.slow
def test_a_killed_run_keeps_the_finished_sections(tmp_path):
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--sections",
                             "sdpa,mfu_layer", "--fail-section", "mfu_layer:hang"], cwd=str(ROOT), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    path, data = tmp_path / "gpu_check.json", None
    try:
        deadline = time.time() + scaled_timeout(120)
        while time.time() < deadline:
            if path.exists():
                data = json.loads(path.read_text())  # never half-written: replaced atomically
                if data["sections"].get("mfu_layer", {}).get("status") == "running":
                    break
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and its hanging section process
        proc.wait()
    assert data is not None and data["sections"]["mfu_layer"]["status"] == "running"
    after = json.loads(path.read_text())
    shutil.rmtree(after["plan"]["work"], ignore_errors=True)  # a killed run cannot remove its work directory
    assert after["sections"]["sdpa"]["status"] == "ok" and after["sections"]["sdpa"]["result"]["available"]
    assert after["finished_utc"] is None


@pytest.mark.slow
def test_no_output_directory_is_an_error(tmp_path):
    proc = _run(["--dry-run"], timeout=60)
    assert proc.returncode == 2
    assert "--out" in proc.stderr and "$OUT" in proc.stderr
    proc = _run(["--dry-run", "--fail-section", "nope"], timeout=60, OUT=str(tmp_path))
    assert proc.returncode == 2 and "--fail-section" in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would measure it")
def test_without_cuda_it_asks_for_dry_run(tmp_path):
    proc = _run([], timeout=120, OUT=str(tmp_path))
    assert proc.returncode == 2
    assert "--dry-run" in proc.stderr and "no CUDA device" in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_help_documents_the_test_hook():
    proc = _run(["--help"], timeout=60)
    assert proc.returncode == 0
    assert "TEST-ONLY HOOK" in proc.stdout and "--fail-section" in proc.stdout
    assert ", ".join(SECTIONS) in proc.stdout
