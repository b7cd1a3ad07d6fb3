#!/usr/bin/env bash
# The GPU install of smelt-ds: the one sequence README.md, docs/cluster.md, docs/environment.md and
# launchers/k8s/Dockerfile use (tests/test_install_gpu.py checks that they do).
#
#   scripts/install_gpu.sh                 # smelt-ds with the wandb and mlflow extras
#   scripts/install_gpu.sh dev             # the extras you name, comma-separated ('' for none)
#   TORCH_INDEX=https://download.pytorch.org/whl/cu130 scripts/install_gpu.sh
#
# Run it from the repository root with the Python of the environment every node sees (PYTHON, default
# `python`: activate the environment first). It installs the CUDA build of torch 2.13.0 from
# PyTorch's wheel index for your CUDA version (TORCH_INDEX, default cu128: pick the one your driver
# supports, see PyTorch's install selector), then smelt-ds against it with the tested set of every
# other package (constraints.txt; its torch==2.13.0 admits the +cuXXX build). DeepSpeed's ops are
# built on first use (DS_BUILD_OPS=0, the default; DS_BUILD_OPS=1 prebuilds them, untested), into
# TORCH_EXTENSIONS_DIR when set. tutel is not on the
# package index: add it yourself (pip install git+https://github.com/microsoft/tutel@main).
set -euo pipefail

PYTHON=${PYTHON:-python}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cu128}
EXTRAS=${1-wandb,mlflow}

if [[ ! -f constraints.txt || ! -f setup.cfg ]]; then
  echo "scripts/install_gpu.sh: run it from the smelt-ds repository root (no constraints.txt here)" >&2
  exit 2
fi
# constraints.txt pins packages with no release for 3.10; only 3.11 was run (docs/environment.md)
version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))'; then
  echo "scripts/install_gpu.sh: Python $version at $(command -v "$PYTHON"): smelt-ds needs Python >= 3.11" \
       "(its tested set, constraints.txt, was run on 3.11); create the environment with it (e.g. uv venv -p 3.11)" >&2
  exit 2
elif [[ $version != 3.11 ]]; then
  echo "scripts/install_gpu.sh: Python $version is untested (the suite ran on 3.11); going on" >&2
fi
"$PYTHON" -m pip install 'torch==2.13.0' --index-url "$TORCH_INDEX"
DS_BUILD_OPS=${DS_BUILD_OPS:-0} "$PYTHON" -m pip install -e ".${EXTRAS:+[$EXTRAS]}" -c constraints.txt
