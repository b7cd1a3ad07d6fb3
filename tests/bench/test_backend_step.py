"""``bench/backend_step.py`` at its smallest setting: one timed round of a 4-expert model, in a subprocess.

The JSON is checked against what is computed here: the first step's loss of a plain
:class:`SmeltLM` on the bench's batch (every backend starts from the same weights; the deepspeed
backend is dropless here, so its loss is the reference's), the parameter tensors of that model
and the deepspeed backend's per-expert split, the tokens per step of the recipe, the arithmetic
of tokens/s, and the printed table parsed back. ``--set moe_runtime.capacity_factor`` is given
too: the reference and autoep backends refuse it, so the run also checks that the bench applies
capacity keys to the deepspeed backend only.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from smelt_ds.config.loading import load_config  # noqa: E402
from smelt_ds.model import SmeltLM  # noqa: E402
from smelt_ds.testing.distributed import scaled_timeout  # noqa: E402
from smelt_ds.train.objective import total_loss  # noqa: E402
from tests.markers import slow_fixture
from tests.numerics import lm_chain_length, prob_tol  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "backend_step.py"
RECIPE = "recipes/tiny/smelt.yaml"
TINY = ["model.vocab_size=64", "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2",
        "model.max_seq_len=32", "moe.num_experts=4", "moe.top_k=2", "moe.expert_ffn_size=16", "train.seq_len=16",
        "train.micro_batch_size=2"]
DS_ONLY = ["moe_runtime.drop_tokens=false", "moe_runtime.capacity_factor=2.0"]


def _bench_module():
    spec = importlib.util.spec_from_file_location("backend_step", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
@slow_fixture
def bench(tmp_path_factory):
    """``(json result, stdout)`` of one run: 1 rank, 1 thread, 1 timed round, no warm-up."""
    out = tmp_path_factory.mktemp("backend_step") / "result.json"
    sets = [a for kv in TINY + DS_ONLY for a in ("--set", kv)]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--recipe", RECIPE, "--repeats", "1", "--warmup", "0",
                           *sets, "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled_timeout(300))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def _reference_model_and_loss() -> tuple[SmeltLM, float]:
    """The model ``build`` makes (seeded with ``train.seed``) and its loss on the bench's batch."""
    cfg = load_config(ROOT / RECIPE, TINY)
    torch.manual_seed(cfg.train.seed)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    ids = _bench_module()._batch(cfg, 0)
    with torch.no_grad():
        return model, float(total_loss(model(ids[:, :-1], labels=ids[:, 1:]), cfg.train))


def test_every_backend_starts_at_the_reference_loss_and_counts_its_tensors(bench):
    res, _ = bench
    assert list(res) == ["reference", "deepspeed", "autoep"]
    model, loss = _reference_model_and_loss()
    # the backends' MoE kernels sum in other orders: a token mean of the forward chain (tests/numerics.py)
    cfg = load_config(ROOT / RECIPE, TINY)
    rel = prob_tol(lm_chain_length(cfg, cfg.train.micro_batch_size * cfg.train.seq_len, backward=False))
    for r in res.values():
        assert r["first_loss"] == pytest.approx(loss, rel=rel)
    n_params = sum(1 for _ in model.parameters())
    moe_layers = sum(1 for b in model.layers if b.is_moe)
    E = 4
    assert res["reference"]["param_tensors"] == n_params
    # DeepSpeed-MoE: gate_up_proj + down_proj of a layer become 3 tensors per expert
    assert res["deepspeed"]["param_tensors"] == n_params + moe_layers * (3 * E - 2)
    assert res["deepspeed"]["dropped_share"] == 0.0  # drop_tokens=false reached the deepspeed backend
    assert res["reference"]["dropped_share"] is None and res["autoep"]["dropped_share"] is None


def test_throughput_arithmetic_and_printed_table(bench):
    res, stdout = bench
    rows = {line.split()[0]: line.split() for line in stdout.splitlines() if line.split()[:1]
            and line.split()[0] in res}
    ref_ms = res["reference"]["step_ms"]
    for name, r in res.items():
        assert r["tokens_per_step"] == 2 * 16  # micro-batch x seq_len, one rank
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / (r["step_ms"] / 1e3), rel=1e-9)
        assert all(v >= 0 for v in r["parts_cpu_ms"].values()) and r["aten_ops_per_step"] > 0
        row = rows[name]
        assert float(row[1]) == pytest.approx(r["step_ms"], abs=0.051)
        assert float(row[2]) == pytest.approx(r["tokens_per_s"], abs=0.51)
        assert float(row[3]) == pytest.approx(ref_ms / r["step_ms"], abs=0.0051)
        assert math.isclose(float(row[-2]), r["first_loss"], abs_tol=5.1e-5)


def test_backend_overrides_keep_capacity_keys_for_deepspeed_only():
    mod = _bench_module()
    user = ["train.seq_len=16", "moe_runtime.capacity_factor=2.0", "moe_runtime.drop_tokens=false"]
    assert mod.backend_overrides("reference", user, 2, None) == ["train.seq_len=16", "moe_runtime.backend=reference"]
    assert mod.backend_overrides("autoep", user, 2, None) == ["train.seq_len=16", "moe_runtime.backend=autoep",
                                                              "moe_runtime.ep_size=2"]
    assert mod.backend_overrides("deepspeed", user, 2, 1) == [*user, "moe_runtime.backend=deepspeed",
                                                              "moe_runtime.ep_size=1"]
