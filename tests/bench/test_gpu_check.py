"""``bench/gpu_check.py --dry-run``: the one-shot GPU script, run on CPU at tiny sizes (CI).

Each test checks the JSON against something computed here, independently of the script:
the recipe's budget (``compute_budget`` of the recorded overrides), the batch shape, the
uniform-prediction loss ``ln(vocab)`` of a freshly initialised model, the eager leg's first
loss for the compiled leg (same weights, same batch), the analytic activation bytes
(``activation_bytes``), the MoE timings' own minimum and ratios, and the text table parsed back.
Tolerances: arithmetic identities 1e-9 relative; values printed with 4 significant digits 1e-3;
the first loss within 5% of ``ln(vocab)`` (aux and z losses add about 0.2%); compiled vs eager
first loss 1e-4 relative (inductor's reassociated fp32 reductions, as tests/parallel/test_compile.py);
measured vs predicted saved-activation bytes within a factor 2 (that it measures the right
quantity; the memory model's accuracy is tests/cost's).

Failure handling: ``--fail-section NAME[:MODE]`` (a test-only hook) makes a section raise, exit
without a result or hang; the run must record it and go on, and a run killed mid-way must leave
the sections it finished in a valid JSON.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from smelt_ds.config.loading import load_config
from smelt_ds.cost.budget import compute_budget
from smelt_ds.parallel.memory import activation_bytes
from smelt_ds.testing.distributed import scaled_timeout, timeout_scale
from tests.numerics import lm_chain_length, prob_tol

# the dry run of every section is shared by most tests here (about 45 s on 2 cores): the module is slow
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
SECTIONS = ["sdpa", "moe_layer", "eval_device", "train_eager", "memory", "train_compiled"]


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


def _cfg(result: dict):
    """The config the section ran, rebuilt here from the recipe and overrides it recorded."""
    return load_config(ROOT / result["variant"]["recipe"], result["variant"]["overrides"])


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


@pytest.mark.parametrize("leg", ["train_eager", "train_compiled"])
def test_training_numbers_follow_from_the_budget(dry, leg):
    r = _result(dry[2], leg)
    cfg = _cfg(r)
    assert cfg.train.compile == ("layers" if leg == "train_compiled" else "none")
    assert (r["micro_batch"], r["seq_len"], r["grad_accum"]) == (2, 32, 1)  # the dry-run plan
    assert r["tokens_per_step"] == cfg.train.micro_batch_size * cfg.train.seq_len == 64
    assert len(r["warmup_step_s"]) == 1 and len(r["timed_step_s"]) == 3
    assert r["median_step_s"] == pytest.approx(statistics.median(r["timed_step_s"]), rel=1e-9)
    assert r["tokens_per_s"] * r["median_step_s"] == pytest.approx(r["tokens_per_step"], rel=1e-2)
    fpt = compute_budget(cfg, cfg.train.seq_len).train_flops_per_token
    assert r["train_flops_per_token"] == pytest.approx(fpt, rel=1e-12)
    assert r["tflops_per_s"] == pytest.approx(r["tokens_per_s"] * fpt / 1e12, rel=1e-9)
    causal = compute_budget(cfg, cfg.train.seq_len, attention_convention="causal").train_flops_per_token
    assert r["tflops_per_s_causal"] == pytest.approx(r["tokens_per_s"] * causal / 1e12, rel=1e-9)
    assert r["mfu"] is None and r["peak_tflops"] is None  # no MFU on CPU
    assert r["first_step_s"] == r["warmup_step_s"][0]
    # a fresh model predicts about uniformly: lm loss ln(V), plus 0.01 * aux (~1) + 0.001 * z (~ln(E)^2)
    assert r["losses"][0] == pytest.approx(math.log(cfg.model.vocab_size), rel=0.05)
    assert all(math.isfinite(x) for x in r["losses"])


def test_compiled_leg_trains_the_same_model(dry):
    eager, comp = _result(dry[2], "train_eager"), _result(dry[2], "train_compiled")
    # same seed, weights, batch; inductor's kernels sum in other orders: Higham & Mary's bound over the
    # forward chain for a token mean (tests/numerics.py)
    cfg = _cfg(eager)
    n = lm_chain_length(cfg, cfg.train.micro_batch_size * cfg.train.seq_len, backward=False)
    assert comp["losses"][0] == pytest.approx(eager["losses"][0], rel=prob_tol(n))
    c = comp["dynamo_counters"]
    assert c["stats"]["unique_graphs"] >= 1  # it did compile
    assert "dynamo_counters" not in eager


@pytest.mark.parametrize("leg", ["train_eager", "train_compiled"])
def test_profile_table_is_consistent(dry, leg):
    p = _result(dry[2], leg)["profile"]
    assert p["steps"] == 1 and 1 <= len(p["top"]) <= 15
    ms = [e["ms"] for e in p["top"]]
    assert ms == sorted(ms, reverse=True)
    assert sum(ms) <= p["total_ms"] * (1 + 1e-9)
    for e in p["top"]:
        assert e["share"] == pytest.approx(e["ms"] / p["total_ms"], rel=1e-9)
        assert e["ms_per_step"] == pytest.approx(e["ms"] / p["steps"], rel=1e-9)
    assert any(e["name"].startswith("aten::") for e in p["top"])  # CPU ops in a dry run


def test_moe_layer_ratios(dry):
    r = _result(dry[2], "moe_layer")
    cfg = load_config(ROOT / "recipes/tiny/smelt.yaml")
    assert r["shape"] == {"hidden": cfg.model.hidden_size, "expert_ffn": cfg.moe.expert_ffn_size,
                          "experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k}
    assert [row["tokens"] for row in r["rows"]] == [64]
    for row in r["rows"]:
        med = row["median_ms"]
        assert {"ours:grouped_mm", "hf:eager", "hf:grouped_mm"} <= set(med)
        assert all(v > 0 for v in med.values())
        hf = {n: v for n, v in med.items() if n.startswith("hf:")}
        assert row["hf_fastest"] == min(hf, key=lambda n: hf[n])
        for n, ratio in row["ratio_to_hf_fastest"].items():
            assert ratio == pytest.approx(med[n] / hf[row["hf_fastest"]], rel=1e-9)


def test_memory_measured_next_to_prediction(dry):
    r = _result(dry[2], "memory")
    cfg = load_config(ROOT / r["recipe"], r["overrides"])
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    predicted = activation_bytes(cfg, r["policy"], B, S, 4, "cpu").stored  # fp32 on CPU
    assert r["predicted_bytes"] == predicted
    assert r["ratio"] == pytest.approx(r["measured_bytes"] / predicted, rel=1e-12)
    # the quantity measured is the saved activations (parameters would be over twice as large); how close
    # the memory model comes is tests/cost's business and what the GPU run reports
    assert 0.5 < r["ratio"] < 2


def test_sdpa_backends(dry):
    r = _result(dry[2], "sdpa")
    cfg = load_config(ROOT / "recipes/tiny/smelt.yaml", ["train.seq_len=32"])
    assert r["shape"]["batch"] == 2 and r["shape"]["seq_len"] == 32
    assert (r["shape"]["heads"], r["shape"]["head_dim"]) == (cfg.model.num_heads, cfg.model.resolved_head_dim)
    assert set(r["forced"]) == {"flash", "efficient", "cudnn", "math"}
    assert r["forced"]["math"]["ok"]  # the math kernel runs anywhere
    assert r["available"] == [b for b, f in r["forced"].items() if f["ok"]]
    assert r["default_backend"] in r["available"]  # what the default picks must run when forced
    assert r["default_aten_ops"] and all(o.startswith("aten::_scaled_dot_product") for o in r["default_aten_ops"])
    for f in r["forced"].values():
        assert f["ok"] == ("fwd_bwd_ms" in f) and f["ok"] != ("error" in f)


def _tables(text: str, column: str) -> list[dict[str, str]]:
    """Rows (column -> cell) of the text tables whose header has ``column``: a header line, a
    line of dashes, then rows up to a blank line."""
    lines, rows = text.splitlines(), []
    for i, line in enumerate(lines[:-1]):
        head = line.split()
        if column in head and set(lines[i + 1]) == {"-"}:
            for row in lines[i + 2:]:
                if not row.strip():
                    break
                rows.append(dict(zip(head, row.split(), strict=True)))
    return rows


def test_text_table_lists_the_json_values(dry):
    _, _, data, text = dry
    train = {row["leg"]: row for row in _tables(text, "TFLOP/s")}
    assert set(train) == {"eager", "compiled"}
    for leg, cells in train.items():
        r = _result(data, f"train_{leg}")
        assert int(cells["tokens/step"]) == r["tokens_per_step"]
        for col, key in (("median_step_s", "median_step_s"), ("tokens/s", "tokens_per_s"),
                         ("TFLOP/s", "tflops_per_s"), ("first_step_s", "first_step_s"), ("compile_s", "compile_s")):
            assert float(cells[col]) == pytest.approx(r[key], rel=1e-3, abs=1e-9), col
        assert cells["MFU"] == "-" and cells["peak_GiB"] == "-"
    mem = _result(data, "memory")
    (cells,) = _tables(text, "measured/predicted")
    assert int(cells["measured_bytes"]) == mem["measured_bytes"]
    assert int(cells["predicted_bytes"]) == mem["predicted_bytes"]
    assert float(cells["measured/predicted"]) == pytest.approx(mem["ratio"], rel=1e-3)
    moe = _result(data, "moe_layer")["rows"][0]
    (cells,) = _tables(text, "ours:grouped_mm/hf")
    assert int(cells["tokens"]) == moe["tokens"] and cells["hf_fastest"] == moe["hf_fastest"]
    assert float(cells["ours:grouped_mm/hf"]) == pytest.approx(moe["ratio_to_hf_fastest"]["ours:grouped_mm"], rel=1e-3)
    assert float(cells["hf:eager_ms"]) == pytest.approx(moe["median_ms"]["hf:eager"], rel=1e-3)
    status = {row["section"]: row["status"] for row in _tables(text, "budget_s")}
    assert status == {n: r["status"] for n, r in data["sections"].items()}
    assert "DRY RUN" in text and "not measurements" in text


def test_out_dir_holds_only_the_outputs(dry):
    out = dry[1]
    assert {p.name for p in out.iterdir()} == {"gpu_check.json", "gpu_check.txt", "logs"}
    assert {p.name for p in (out / "logs").iterdir()} == {f"{s}.log" for s in SECTIONS}
    assert not [p for p in out.rglob("*") if "tmp" in p.name]


def test_section_failures_are_recorded_and_the_run_goes_on(tmp_path):
    # the hanging section waits out its share of the budget: 35 s x 0.06 / 0.35 = 6 s (above
    # MIN_SECTION_S; not multiplied by the timeout scale, which would only make the test wait longer),
    # while the sections after it (about 2-4 s each here, 3x that on a loaded machine) get the other 29 s
    proc = _run(["--dry-run", "--out", str(tmp_path), "--sections", "sdpa,moe_layer,memory", "--budget-s", "35",
                 "--fail-section", "sdpa:hang", "--fail-section", "moe_layer"], timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(data["sections"]) == ["sdpa", "moe_layer", "memory"]
    hung, raised, ok = (data["sections"][n] for n in ("sdpa", "moe_layer", "memory"))
    assert hung["status"] == "timeout" and "ran past" in hung["error"]["message"]
    assert hung["elapsed_s"] == pytest.approx(hung["budget_s"], abs=scaled_timeout(10))
    assert raised["status"] == "failed" and raised["error"]["type"] == "RuntimeError"
    assert "forced failure of section 'moe_layer'" in raised["error"]["message"]
    assert "_forced_failure" in raised["error"]["traceback_tail"]
    assert ok["status"] == "ok" and ok["result"]["measured_bytes"] > 0
    assert data["summary"]["sections_not_ok"] == ["sdpa", "moe_layer"]
    text = (tmp_path / "gpu_check.txt").read_text()
    assert "forced failure of section 'moe_layer'" in text and "timeout" in text


def test_a_section_that_dies_is_recorded(tmp_path):
    proc = _run(["--dry-run", "--out", str(tmp_path), "--sections", "sdpa", "--fail-section", "sdpa:exit"],
                timeout=120)
    assert proc.returncode == 1
    rec = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["sdpa"]
    assert rec["status"] == "failed" and rec["error"]["type"] == "ChildExit"
    assert "exited with status 3" in rec["error"]["message"]


def test_a_killed_run_keeps_the_finished_sections(tmp_path):
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--sections",
                             "sdpa,moe_layer", "--fail-section", "moe_layer:hang"], cwd=str(ROOT), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    path, data = tmp_path / "gpu_check.json", None
    try:
        deadline = time.time() + scaled_timeout(120)
        while time.time() < deadline:
            if path.exists():
                data = json.loads(path.read_text())  # never half-written: replaced atomically
                if data["sections"].get("moe_layer", {}).get("status") == "running":
                    break
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and its hanging section process
        proc.wait()
    assert data is not None and data["sections"]["moe_layer"]["status"] == "running"
    after = json.loads(path.read_text())
    assert after["sections"]["sdpa"]["status"] == "ok" and after["sections"]["sdpa"]["result"]["available"]
    assert after["finished_utc"] is None


def test_no_output_directory_is_an_error(tmp_path):
    proc = _run(["--dry-run"], timeout=60)
    assert proc.returncode == 2
    assert "--out" in proc.stderr and "$OUT" in proc.stderr
    proc = _run(["--dry-run", "--fail-section", "nope"], timeout=60, OUT=str(tmp_path))
    assert proc.returncode == 2 and "--fail-section" in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would measure it")
def test_without_cuda_it_asks_for_dry_run(tmp_path):
    proc = _run([], timeout=120, OUT=str(tmp_path))
    assert proc.returncode == 2
    assert "--dry-run" in proc.stderr and "no CUDA device" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_help_documents_the_test_hook():
    proc = _run(["--help"], timeout=60)
    assert proc.returncode == 0
    assert "TEST-ONLY HOOK" in proc.stdout and "--fail-section" in proc.stdout
