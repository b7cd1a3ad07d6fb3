"""`smelt-ds eval --device / --dtype`: the models run where and in what dtype they are asked to,
the numbers are those of a plain-PyTorch evaluation of the same model in that dtype, and what a
machine cannot do is one clear error. The CUDA path runs in bench/gpu_check.py (section
``tiny_journey``: ``--device cuda`` against the export on ``--device cpu --dtype float32``), on a GPU
machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from smelt_ds.errors import ConfigError
from smelt_ds.eval.benchmarks import unreachable_data_error
from smelt_ds.eval.device import resolve_device, resolve_dtype
from smelt_ds.testing import scaled_timeout

SEQ, MICRO, BATCHES = 32, 2, 2


def _cli(*argv) -> int:
    from smelt_ds.cli import main

    return main([str(a) for a in argv])


def test_cuda_on_a_machine_without_it_names_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"`--device` \('cuda'\): CUDA is not available on this machine.*"
                                          r"--device cpu"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match=r"`--device` \('tpu'\) is not a device"):
        resolve_device("tpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(ConfigError, match=r"`--dtype` \('float16'\) is unknown"):
        resolve_dtype("float16", torch.device("cpu"))


def _reference_losses(export, dtype: torch.dtype) -> dict[str, float]:
    """Per-domain loss of the export in ``dtype``, computed here: the same windows, the model's
    logits read in fp32, cross-entropy summed in fp64."""
    from smelt_ds.eval.data import open_eval_data
    from smelt_ds.runs.load import load_runs

    (run,) = load_runs([str(export)])
    model = run.model.to(dtype).eval()
    data = open_eval_data(run.cfg, run.eval_split)
    out = {}
    with torch.no_grad():
        for dom in data.domains:
            nats, tokens = 0.0, 0
            for b in data.batches(dom, SEQ, MICRO, BATCHES, 1):
                logits = model(b["input_ids"]).logits.float()
                V = logits.shape[-1]
                nll = F.cross_entropy(logits.reshape(-1, V), b["labels"].reshape(-1), ignore_index=-100,
                                      reduction="none")
                nats += float(nll.double().sum())  # per-token values in fp32, summed in fp64
                tokens += int((b["labels"] != -100).sum())
            out[dom] = nats / tokens
    return out


def test_eval_in_bfloat16_on_the_cpu_equals_a_plain_bfloat16_evaluation(random_exports, tmp_path, capsys):
    """``--device cpu --dtype bfloat16`` evaluates the model converted to bf16: its losses are the
    plain bf16 evaluation's (the same operations: float64 sums of the same per-token values in
    another grouping, 1e-12 relative), and differ from float32's (the dtype took effect: bf16
    rounds weights and activations to 8 significant bits, ~1e-3 relative, far above 1e-12)."""
    export = random_exports["smelt"]
    args = ["eval", export, "--seq-len", SEQ, "--batches", BATCHES, "--micro-batch", MICRO, "--episodes", "1",
            "--shots", "0", "--tasks", "pattern", "--no-plots", "--device", "cpu"]
    assert _cli(*args, "--dtype", "bfloat16", "-o", tmp_path / "bf16") == 0
    assert "evaluating on cpu in bfloat16" in capsys.readouterr().out
    assert _cli(*args, "-o", tmp_path / "fp32") == 0
    got = {d: v["loss"] for d, v in json.loads((tmp_path / "bf16" / "eval.json").read_text())["domains"][
        "tiny-smelt"].items() if d != "all"}
    fp32 = {d: v["loss"] for d, v in json.loads((tmp_path / "fp32" / "eval.json").read_text())["domains"][
        "tiny-smelt"].items() if d != "all"}
    want_bf16, want_fp32 = _reference_losses(export, torch.bfloat16), _reference_losses(export, torch.float32)
    assert got.keys() == want_bf16.keys() and len(got) >= 2
    for d in got:
        assert got[d] == pytest.approx(want_bf16[d], rel=1e-12), d
        assert fp32[d] == pytest.approx(want_fp32[d], rel=1e-12), d
        assert abs(got[d] - fp32[d]) > 1e-6 * fp32[d], d


def test_a_harness_task_whose_data_cannot_be_downloaded_names_its_offline_twin(random_exports, tmp_path):
    """Offline (the Hub unreachable or set offline), ``--harness arc_easy`` (lm-eval's Hub task)
    ends in one message naming ``arc_easy_val`` and ``smelt-ds eval fetch-benchmarks``, not a
    ``datasets`` traceback."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "SMELT_DS_CACHE": str(tmp_path / "c")}
    proc = subprocess.run([sys.executable, "-m", "smelt_ds.cli", "eval", str(random_exports["smelt"]), "--harness",
                           "arc_easy", "--limit", "1", "-o", str(tmp_path / "out"), "--device", "cpu"],
                          capture_output=True, text=True, env=env, timeout=scaled_timeout(300))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "arc_easy -> arc_easy_val" in proc.stderr and "smelt-ds eval fetch-benchmarks" in proc.stderr


def test_only_download_failures_are_translated():
    class LocalEntryNotFoundError(Exception):
        pass

    try:
        try:
            raise LocalEntryNotFoundError("offline")
        except LocalEntryNotFoundError as inner:
            raise ConnectionError("Couldn't reach 'allenai/ai2_arc' on the Hub (LocalEntryNotFoundError)") from inner
    except ConnectionError as e:
        err = unreachable_data_error(["arc_easy", "hellaswag"], e)
    assert err is not None and "arc_easy -> arc_easy_val, hellaswag -> hellaswag_val" in str(err)
    assert "--harness arc_easy_val,hellaswag_val" in str(err)
    assert unreachable_data_error(["arc_easy"], ValueError("a bad metric")) is None
