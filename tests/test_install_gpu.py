"""One GPU install sequence: ``scripts/install_gpu.sh``, run by the Dockerfile and the only one the
docs give. Run here with a stand-in ``python`` that records the pip commands (no package is
installed) and answers the version check with the real interpreter, told another version."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install_gpu.sh"


def _stand_in(tmp_path: Path, version: tuple[int, int]) -> Path:
    log = tmp_path / "pip.log"
    stub = tmp_path / "python"
    stub.write_text(f"""#!/usr/bin/env bash
if [[ $1 == -c ]]; then
  exec {sys.executable} -c "import sys; sys.version_info = {version + (0,)!r}; $2"
fi
echo "DS_BUILD_OPS=${{DS_BUILD_OPS-unset}} $*" >> {log}
""")
    stub.chmod(0o755)
    return stub


def _run(tmp_path: Path, version: tuple[int, int], *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list]:
    tmp_path.mkdir(exist_ok=True)
    stub = _stand_in(tmp_path, version)
    proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**{k: v for k, v in os.environ.items() if k != "DS_BUILD_OPS"}, "PYTHON": str(stub),
                               **env})
    log = tmp_path / "pip.log"
    return proc, (log.read_text().splitlines() if log.exists() else [])


def test_the_script_installs_the_cuda_torch_then_smelt_ds_with_the_tested_set(tmp_path):
    proc, pip = _run(tmp_path, (3, 11))
    assert proc.returncode == 0, proc.stderr
    assert pip == ["DS_BUILD_OPS=unset -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128",
                   "DS_BUILD_OPS=0 -m pip install -e .[wandb,mlflow] -c constraints.txt"]
    proc, pip = _run(tmp_path / "b", (3, 11), "dev", TORCH_INDEX="https://download.pytorch.org/whl/cu130")
    assert pip[-2:] == ["DS_BUILD_OPS=unset -m pip install torch==2.13.0 --index-url "
                        "https://download.pytorch.org/whl/cu130",
                        "DS_BUILD_OPS=0 -m pip install -e .[dev] -c constraints.txt"]


def test_a_prebuild_of_deepspeeds_ops_is_passed_on(tmp_path):
    _, pip = _run(tmp_path, (3, 11), DS_BUILD_OPS="1")
    assert pip[-1] == "DS_BUILD_OPS=1 -m pip install -e .[wandb,mlflow] -c constraints.txt"


def test_python_older_than_3_11_is_refused_and_a_newer_one_is_called_untested(tmp_path):
    proc, pip = _run(tmp_path, (3, 10))
    assert proc.returncode == 2 and pip == []
    assert "Python 3.10" in proc.stderr and "needs Python >= 3.11" in proc.stderr
    proc, pip = _run(tmp_path / "b", (3, 12))
    assert proc.returncode == 0 and "Python 3.12 is untested" in proc.stderr and len(pip) >= 2


def test_readme_docs_and_image_use_the_script_and_no_other_gpu_install():
    for name in ("README.md", "docs/cluster.md", "docs/environment.md", "launchers/k8s/Dockerfile",
                 "launchers/slurm/smelt.sbatch", "launchers/deepspeed/run.sh"):  # the jobs name it when it is missing
        text = (ROOT / name).read_text()
        assert "scripts/install_gpu.sh" in text, name
    for name in ("docs/cluster.md", "docs/environment.md", "launchers/k8s/Dockerfile"):
        text = (ROOT / name).read_text()
        assert not re.search(r"pip install\s+['\"]?torch", text), name  # the torch install is the script's
    dockerfile = (ROOT / "launchers" / "k8s" / "Dockerfile").read_text()
    assert re.search(r"uv venv .*-p 3\.11", dockerfile)  # the Python the suite ran on
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"runs", "evals", "exports", "corpora", ".git"} <= set(ignored)
