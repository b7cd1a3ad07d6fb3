"""smelt_ds/import_hooks.py: DeepSpeed's autotuner does not import MLflow in smelt-ds processes,
and everything else still does."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

from smelt_ds import import_hooks
from smelt_ds.train.loop import launcher_command

needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                  reason="MLflow is not installed (pip install 'smelt-ds[mlflow]'): nothing to skip")

_PROBE = """
import json, sys
{first}
import deepspeed
from deepspeed.autotuning import autotuner
after_deepspeed = "mlflow" in sys.modules
import mlflow
print(json.dumps({{"after_deepspeed": after_deepspeed, "has_mlflow": autotuner.has_mlflow,
                  "client": mlflow.MlflowClient.__name__}}))
"""


def _probe(first: str, env: dict[str, str] | None = None) -> dict:
    """Import ``deepspeed`` after ``first`` in a fresh interpreter, then MLflow: what was imported."""
    out = subprocess.run([sys.executable, "-c", _PROBE.format(first=first)], capture_output=True, text=True,
                         timeout=120, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


@needs_mlflow
@pytest.mark.slow
def test_deepspeed_skips_mlflow_after_smelt_ds_and_mlflow_still_imports():
    # the control: without smelt_ds, this DeepSpeed imports MLflow (if a release stops, the hook is obsolete)
    assert _probe("") == {"after_deepspeed": True, "has_mlflow": True, "client": "MlflowClient"}
    # with it: not imported by DeepSpeed, which records it has none; our tracker's import gets the real one
    assert _probe("import smelt_ds") == {"after_deepspeed": False, "has_mlflow": False, "client": "MlflowClient"}


def test_finder_refuses_mlflow_only_while_the_autotuner_executes(monkeypatch):
    finder = import_hooks.DeepSpeedAutotunerWithoutMlflow()
    spec = types.SimpleNamespace(_initializing=True)
    monkeypatch.setitem(sys.modules, import_hooks.AUTOTUNER, types.SimpleNamespace(__spec__=spec))
    with pytest.raises(ImportError, match="DeepSpeed's autotuner"):
        finder.find_spec("mlflow", None)
    assert finder.find_spec("mlflow.tracking", None) is None  # only the top-level import DeepSpeed makes
    assert finder.find_spec("wandb", None) is None
    spec._initializing = False  # the autotuner has been imported: mlflow imports normally
    assert finder.find_spec("mlflow", None) is None
    monkeypatch.delitem(sys.modules, import_hooks.AUTOTUNER)
    assert finder.find_spec("mlflow", None) is None


def test_install_adds_the_finder_once(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path
                                           if not isinstance(f, import_hooks.DeepSpeedAutotunerWithoutMlflow)])
    import_hooks.install()
    import_hooks.install()
    hooks = [f for f in sys.meta_path if isinstance(f, import_hooks.DeepSpeedAutotunerWithoutMlflow)]
    assert len(hooks) == 1 and sys.meta_path[0] is hooks[0]


@needs_mlflow
@pytest.mark.slow
def test_the_launchers_processes_skip_mlflow_and_still_run_the_sitecustomize_they_shadow(tmp_path, monkeypatch):
    """DeepSpeed's runner.py and launch.py do not import smelt_ds: ``smelt-ds train --nproc``'s
    command puts a sitecustomize first on their PYTHONPATH that installs the hook, and then runs
    the sitecustomize it shadows (here a stand-in for a user's, or the tests' fault injector)."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIR_SITECUSTOMIZE_RAN'] = '1'\n")
    monkeypatch.setenv("PYTHONPATH", str(theirs))
    cmd = launcher_command(argparse.Namespace(nproc=2, recipe="r.yaml", resume="none", set=[], run_dir=None))
    assert cmd[0] == "env" and cmd[1].startswith("PYTHONPATH=") and cmd[2] == sys.executable
    assert cmd[3:5] == ["-m", "deepspeed.launcher.runner"]
    env = {**os.environ, "PYTHONPATH": cmd[1].removeprefix("PYTHONPATH=")}
    ran = "import os; assert os.environ.get('THEIR_SITECUSTOMIZE_RAN') == '1', 'the shadowed sitecustomize did not run'"
    assert _probe(ran, env) == {"after_deepspeed": False, "has_mlflow": False, "client": "MlflowClient"}
    # the control: their sitecustomize alone runs, and DeepSpeed imports MLflow
    assert _probe(ran, {**os.environ, "PYTHONPATH": str(theirs)})["after_deepspeed"] is True
