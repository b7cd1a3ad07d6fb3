#!/usr/bin/env bash
# Lower-bound check (manual; not part of .ci/run): installs smelt-ds[dev] into a fresh virtual
# environment with every direct requirement of setup.cfg at the LOWEST version its range allows
# (uv's --resolution lowest-direct), checks that the resolver really installed each declared floor
# (a floor it had to raise is an untested floor: fix setup.cfg), then runs the fast tests and the
# version-sensitive paths (AutoEP with ZeRO-3, DeepSpeed-MoE, grad norm, HF export, lm-eval harness).
# What it found, and why each bound is what it is: docs/environment.md.
#
#   bash scripts/check_lower_bounds.sh [VENV]        # VENV defaults to /tmp/lowvenv (recreated)
#
# On a machine shared with others, run it under the heavy-test lock:
#   flock /tmp/smelt-heavy.lock bash scripts/check_lower_bounds.sh
#
# Environment: TORCH_REQ (default torch==2.13.0+cpu, the oldest torch tested: older CPU builds are not
# available here) and FIND_LINKS (default /opt/wheels, the folder holding that wheel; with a CUDA
# torch use e.g. TORCH_REQ=torch==2.13.0 FIND_LINKS= and your index through UV_INDEX_URL / UV_EXTRA_INDEX_URL).
# STAGE=install stops after the install and the floor check; AUTOEP_Z3_VERSIONS="0.19.6 0.19.7" (with
# STAGE=autoep-z3 to stop there) runs AutoEP at ZeRO-3 against those DeepSpeed versions.
# About 2 min to install, 30 min of tests on 2 quiet cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-/tmp/lowvenv}"
TORCH_REQ="${TORCH_REQ:-torch==2.13.0+cpu}"
FIND_LINKS="${FIND_LINKS-/opt/wheels}"
export SMELT_TEST_TIMEOUT_SCALE="${SMELT_TEST_TIMEOUT_SCALE:-3}"

if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ]; then
  echo "$VENV exists and is not a virtual environment: name another folder" >&2
  exit 2
fi
rm -rf "$VENV"
python -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --disable-pip-version-check uv
UV=("$VENV/bin/uv" pip install --python "$PY")
[ -n "$FIND_LINKS" ] && UV+=(--find-links "$FIND_LINKS")
PIN="$VENV/torch-pin.txt"
echo "$TORCH_REQ" > "$PIN"

# torch first, and pinned by a constraint: `torch>=2.13` at its lowest would otherwise be the index's
# 2.13.0 (a CUDA build) instead of the local 2.13.0+cpu.
"${UV[@]}" -c "$PIN" "$TORCH_REQ" setuptools wheel
# DeepSpeed is an sdist whose setup.py imports torch: build it against the torch above (no isolated
# build environment, which would download another torch), without compiled ops (they JIT-build on use).
DS_BUILD_OPS=0 "${UV[@]}" -c "$PIN" --resolution lowest-direct --no-build-isolation-package deepspeed -e '.[dev]'

echo "== declared floors vs installed (setup.cfg install_requires and every extra)"
"$PY" - <<'EOF'
import configparser, importlib.metadata as md, sys
from packaging.requirements import Requirement
from packaging.version import Version

cp = configparser.ConfigParser()
cp.read("setup.cfg")
lines = cp["options"]["install_requires"].splitlines()
for value in cp["options.extras_require"].values():
    lines += value.splitlines()
reqs = {}
for line in lines:
    line = line.strip()
    if line and not line.startswith("#"):
        r = Requirement(line)
        reqs[r.name] = r
raised = []
for name, r in sorted(reqs.items()):
    floor = next((s.version for s in r.specifier if s.operator == ">="), None)
    got = md.version(name)
    mark = ""
    if floor is not None and Version(Version(got).public) != Version(floor):  # 6.0 == 6.0.0; 2.13.0+cpu is 2.13
        mark = "  <- resolver raised the floor: the declared floor is untested"
        raised.append(name)
    print(f"  {name:16s} {str(r.specifier):18s} installed {got}{mark}")
if raised:
    sys.exit(f"raise these floors in setup.cfg to the installed versions: {raised}")
EOF
"$VENV/bin/uv" pip freeze --python "$PY" > "$VENV/freeze.txt"  # the whole set, transitive ones included
echo "the installed set: $VENV/freeze.txt"
[ "${STAGE:-}" = install ] && exit 0

if [ -n "${AUTOEP_Z3_VERSIONS:-}" ]; then
  # Which DeepSpeed runs AutoEP at ZeRO-3 as smelt-ds drives it (AutoEP replaces layers.{i}.mlp inside
  # deepspeed.initialize, which then calls smelt-ds's optimizer factory): the half without activation
  # checkpointing of tests/parallel/moe_backends/test_autoep.py::test_autoep_zero3_matches_reference, 2 ranks, 3 steps, against each version in turn
  # (e.g. AUTOEP_Z3_VERSIONS="0.19.2 0.19.3 0.19.6 0.19.7"); the floor is reinstalled afterwards.
  mkdir -p "$VENV/z3check"
  cat > "$VENV/z3check/autoep_z3_check.py" <<'PYEOF'
import torch


def worker(rank, world, steps):
    import deepspeed

    import tests.parallel.moe_backends.backend_helpers as T
    from smelt_ds.parallel import moe_backends as mb
    from smelt_ds.parallel.ds_config import expert_parallel_section

    cfg = T.tiny_cfg(backend="autoep", ep_size=2)
    model = mb.apply_backend(T.build(cfg), cfg, zero_stage=3)
    engine, *_ = deepspeed.initialize(
        model=model, config=T.ds_config(3, expert_parallel=expert_parallel_section(cfg)),
        model_parameters=[{"params": list(model.parameters()), "name": "all"}],
        optimizer=mb.moe_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.0))
    rows = []
    for ids in T.shard_batches(steps, rank):
        out = engine(ids[:, :-1], labels=ids[:, 1:])
        engine.backward(T.objective(out))
        engine.step()
        rows.append((T.objective(out).item(), out.aux_loss.item(), out.z_loss.item()))
    return rows


if __name__ == "__main__":
    import deepspeed
    import pytest

    import tests.parallel.moe_backends.backend_helpers as T
    from autoep_z3_check import worker as w  # importable by the spawned ranks
    from smelt_ds.testing import run_distributed

    ranks = run_distributed(w, world_size=T.WORLD, timeout=T.TIMEOUT_S, args=(3,))
    ref = T.reference_run(T.tiny_cfg(), 3)
    for s in range(3):
        for r, rows in enumerate(ranks):
            assert rows[s] == pytest.approx(ref[s][r], rel=T.loss_tol(s + 1)), (s, r, rows[s], ref[s][r])
    print(f"deepspeed {deepspeed.__version__}: AutoEP ZeRO-3, 3 steps equal the reference within {T.loss_tol(3):.1e}")
PYEOF
  DS_FLOOR="$("$PY" -c 'import importlib.metadata as m; print(m.version("deepspeed"))')"
  for v in $AUTOEP_Z3_VERSIONS; do
    DS_BUILD_OPS=0 "${UV[@]}" -q -c "$PIN" --no-build-isolation-package deepspeed "deepspeed==$v"
    echo "== AutoEP at ZeRO-3 with deepspeed $v"
    PYTHONPATH="$VENV/z3check:$PWD" "$PY" "$VENV/z3check/autoep_z3_check.py" 2>&1 \
      | grep -E "^deepspeed |^[A-Za-z]+Error: " | sort -u || true
  done
  DS_BUILD_OPS=0 "${UV[@]}" -q -c "$PIN" --no-build-isolation-package deepspeed "deepspeed==$DS_FLOOR"
fi
[ "${STAGE:-}" = autoep-z3 ] && exit 0

echo "== fast tests (not slow, not distributed)"
"$PY" -m pytest -m "not slow and not distributed" -q -p no:cacheprovider -o addopts="" -ra
echo "== version-sensitive paths, all markers: MoE backends (AutoEP ZeRO-0/2/3, DeepSpeed-MoE), grad norm,"
echo "   HF export and lm-eval's hf model, the harness, DeepSpeed activation checkpointing, compile, a run's export"
"$PY" -m pytest tests/parallel/moe_backends tests/parallel/test_grad_norm.py \
  tests/interop/test_export.py tests/eval/test_harness.py tests/parallel/test_activation_checkpointing.py \
  tests/parallel/test_compile.py tests/train/test_loop.py::test_run_directory_summary_export_and_init_from \
  -q -p no:cacheprovider -o addopts="" -ra
echo "== AutoEP cells of the export matrix (train 2 ranks, export, eval, init_from)"
"$PY" -m pytest tests/runs/test_export_matrix.py -k autoep -q -p no:cacheprovider -o addopts="" -ra
echo "== lint and types with the dev floors (configured in pyproject.toml)"
"$PY" -m ruff check .
"$PY" -m mypy --cache-dir "$VENV/mypy-cache"
