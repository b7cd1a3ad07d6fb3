"""``smelt-ds preflight``: each check refuses a bad input, and training (``python -m
smelt_ds.train``, one process) refuses the same input at start with the same message; the
checks run in the job's working directory and environment; a Kubernetes job's checks of this
machine only warn."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from smelt_ds.cli import main as cli_main
from tests.data.token_test_utils import word_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny" / "smelt.yaml")


def _closed_port() -> int:
    """A local port nothing listens on (bound, then closed: a connection is refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(out: str) -> dict[str, tuple[str, str]]:
    """The printed checks: name -> (status, detail)."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("  ") and len(line) > 20 and line[16:22].strip() in ("OK", "FAIL", "WARN", "SKIP"):
            rows[line[2:16].strip()] = (line[16:22].strip(), line[22:])
    return rows


# (check, --set overrides, what both preflight and training say); {tmp} and {port} are filled in
CASES = [
    ("config", ["deepspeed.config.gradient_clipping=1.0"], "is set by the recipe field train.grad_clip"),
    ("config", ["deepspeed.template=nope"], "`deepspeed.template` ('nope'): no file"),
    ("data", ["data.sources=[{{path: {tmp}/corpora/missing.txt}}]"],
     "`data.sources[0].path` ('{tmp}/corpora/missing.txt'): no such file or directory"),
    ("tokenizer", ["data.tokenizer.path={tmp}/tokenizer.json"],
     "`data.tokenizer.path` ('{tmp}/tokenizer.json'): no such tokenizer file"),
    ("trackers", ["tracking.trackers=[mlflow]", "tracking.mlflow.tracking_uri=http://127.0.0.1:{port}"],
     "`tracking.mlflow.tracking_uri` (http://127.0.0.1:{port}): no MLflow server answered"),
    ("interpreter", ["moe_runtime.backend=deepspeed", "moe_runtime.use_tutel=true"],
     "`moe_runtime.use_tutel` (True) needs the optional package `tutel`"),
    ("tokenizer", ["data.tokenizer.path={tmp}/tok.json", "data.tokenizer.pad_token=<|padding|>"],
     "`data.tokenizer.pad_token` ('<|padding|>') is not in the tokenizer's vocabulary"),
    ("data", ["train.init_from={tmp}/export"], "`train.init_from` ('{tmp}/export') is not an export directory"),
]


@pytest.mark.parametrize("check,sets,message", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_check_refuses_what_training_refuses_at_start(check, sets, message, tmp_path, capsys):
    if check == "interpreter" and "tutel" in sys.modules or os.environ.get("SMELT_TUTEL_INSTALLED"):
        pytest.skip("tutel is installed here")
    port = _closed_port()
    word_tokenizer(tmp_path / "tok.json", 1000)  # specials <|endoftext|> and <|pad|>
    sets = [s.format(tmp=tmp_path, port=port) for s in sets]
    message = message.format(tmp=tmp_path, port=port)
    argv = [x for s in sets for x in ("--set", s)]
    rc = cli_main(["preflight", TINY, "--nodes", "1", "--gpus-per-node", "1", *argv])
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rc == 2 and rows[check][0] == "FAIL" and message in rows[check][1], out
    assert [name for name, (status, _) in rows.items() if status == "FAIL"] == [check], out  # only this one
    train = subprocess.run([sys.executable, "-m", "smelt_ds.train", TINY, *argv,
                            "--set", f"train.run_dir={tmp_path / 'run'}"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert train.returncode == 2 and message in train.stderr, train.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # refused before the run directory


def test_memory_and_deepspeed_ops_fail_naming_the_fix(tmp_path, capsys, monkeypatch):
    """What training cannot refuse on a CPU (a GPU's memory) or refuses only by failing a JIT build
    (no C++ compiler for DeepSpeed's CPU Adam) is found by preflight, naming the fix."""
    assert cli_main(["preflight", str(ROOT / "recipes/xl/smelt.yaml"), "--nodes", "1", "--gpus-per-node", "8",
                     "--no-data-check"]) == 2
    status, detail = _rows(capsys.readouterr().out)["memory"]
    assert status == "FAIL" and "per GPU on 1 x 8 GPUs of 79.1 GiB" in detail and "smelt-ds memory RECIPE" in detail
    offload = ["--set", "deepspeed.zero_stage=2", "--set", "deepspeed.offload_optimizer=cpu"]
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cli_main(["preflight", TINY, "--nodes", "1", "--gpus-per-node", "1", *offload]) == 2
    status, detail = _rows(capsys.readouterr().out)["deepspeed ops"]
    assert status == "FAIL" and "cpu_adam" in detail and f"the C++ compiler '{tmp_path / 'no-such-compiler'}' ($CXX) " \
        "is not on PATH" in detail
    monkeypatch.delenv("CXX")
    assert cli_main(["preflight", TINY, "--nodes", "1", "--gpus-per-node", "1", *offload]) == 0
    assert "CPUAdamBuilder for deepspeed.offload_optimizer" in _rows(capsys.readouterr().out)["deepspeed ops"][1]


def test_checks_use_the_jobs_working_directory_and_environment(tmp_path, capsys, monkeypatch):
    """A relative data path is read in --workdir, not here; a tracker address given with --env
    (as the job exports it) is what is probed; a pod's checks of this machine only warn."""
    wd = tmp_path / "wd"
    (wd / "corpora").mkdir(parents=True)
    (wd / "corpora" / "web.txt").write_text("some text\n" * 50)
    monkeypatch.chdir(tmp_path)
    data = ["--set", "data.sources=[{path: corpora/web.txt}]", "--nodes", "1", "--gpus-per-node", "1"]
    assert cli_main(["preflight", TINY, *data, "--workdir", str(wd)]) == 0
    assert _rows(capsys.readouterr().out)["data"][0] == "OK"
    assert cli_main(["preflight", TINY, *data]) == 2  # here (tmp_path) there is no corpora/
    assert f"read from the working directory {str(tmp_path)!r}" in _rows(capsys.readouterr().out)["data"][1]

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    mlflow = ["--set", "tracking.trackers=[mlflow]", "--nodes", "1", "--gpus-per-node", "1"]
    port = _closed_port()
    assert cli_main(["preflight", TINY, *mlflow, "--env", f"MLFLOW_TRACKING_URI=http://127.0.0.1:{port}"]) == 2
    assert f"http://127.0.0.1:{port}" in _rows(capsys.readouterr().out)["trackers"][1]
    assert "MLFLOW_TRACKING_URI" not in os.environ  # restored after the checks
    store = ["--set", f"tracking.mlflow.tracking_uri=file:{tmp_path / 'mlruns'}"]
    assert cli_main(["preflight", TINY, *mlflow, *store]) == 2  # MLflow 3 refuses a file store unless allowed
    assert "MLFLOW_ALLOW_FILE_STORE=true" in _rows(capsys.readouterr().out)["trackers"][1]
    assert cli_main(["preflight", TINY, *mlflow, *store, "--env", "MLFLOW_ALLOW_FILE_STORE=true"]) == 0
    capsys.readouterr()

    k8s = ["--scheduler", "k8s", "--set", "data.sources=[{path: corpora/web.txt}]", "--nodes", "1",
           "--gpus-per-node", "1", "--set", "tracking.trackers=[wandb]"]
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails here; the image may have it
    assert cli_main(["preflight", TINY, *k8s]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["data"][0] == "OK" and "every path is in a volume of the pod" in rows["data"][1]
    assert cli_main(["preflight", TINY, *k8s, "--set", "data.sources=[{path: /home/me/web.txt}]"]) == 2
    status, detail = _rows(capsys.readouterr().out)["data"]  # what render-job refuses, named before it
    assert status == "FAIL" and "`data.sources[0].path` ('/home/me/web.txt'" in detail and "in no volume" in detail
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert rows["trackers"][0] == "WARN" and "a Kubernetes pod sees its own image and mounts" in rows["trackers"][1]


def test_a_recipe_that_does_not_resolve_stops_before_the_other_checks(capsys):
    assert cli_main(["preflight", TINY, "--nodes", "1", "--gpus-per-node", "1",
                     "--set", "train.global_batch_tokens=3000"]) == 2
    out = capsys.readouterr().out
    assert "config        FAIL  `train.global_batch_tokens` (3000)" in out and "memory" not in out


def test_an_unreachable_wandb_server_is_refused_by_preflight_and_by_training(tmp_path, capsys, monkeypatch):
    """W&B online (the default mode) with WANDB_BASE_URL on a closed port: preflight (the variable
    given with --env, as the job exports it) and training (the variable set) refuse it at start,
    naming the server and offline mode."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    url = f"http://127.0.0.1:{_closed_port()}"
    message = f"the W&B server {url} did not answer"
    sets = ["--set", "tracking.trackers=[wandb]"]
    assert cli_main(["preflight", TINY, "--nodes", "1", "--gpus-per-node", "1", *sets,
                     "--env", f"WANDB_BASE_URL={url}"]) == 2
    status, detail = _rows(capsys.readouterr().out)["trackers"]
    assert status == "FAIL" and message in detail and "tracking.wandb.mode=offline" in detail
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    train = subprocess.run([sys.executable, "-m", "smelt_ds.train", TINY, *sets, "--set",
                            f"train.run_dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300, env={**env, "WANDB_BASE_URL": url})
    assert train.returncode == 2 and message in train.stderr, train.stderr[-2000:]
