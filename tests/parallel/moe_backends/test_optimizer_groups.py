"""Optimizer groups of the MoE backends (smelt_ds/parallel/moe_backends/optimizer_groups.py): expert
parameters in DeepSpeed's ``moe`` groups with their group's options kept."""

from __future__ import annotations

import pytest

deepspeed = pytest.importorskip("deepspeed")

from smelt_ds.parallel.moe_backends import optimizer_groups  # noqa: E402
from smelt_ds.parallel.moe_backends.apply import apply_backend  # noqa: E402
from tests.parallel.moe_backends.backend_helpers import build, tiny_cfg  # noqa: E402


def test_split_params_into_moe_groups_keeps_group_options():
    cfg = tiny_cfg(backend="deepspeed")
    model = apply_backend(build(tiny_cfg()), cfg)
    params = list(model.parameters())
    groups = [{"params": params[:5], "weight_decay": 0.0, "lr_scale": 1.0},
              {"params": params[5:], "weight_decay": 0.1, "lr_scale": 0.5, "name": "decay"}]
    out = optimizer_groups.optimizer_param_groups(model, groups, cfg)
    moe_groups = [g for g in out if g.get("moe")]
    assert moe_groups and all(g["name"] == "ep_size_1" for g in moe_groups)
    assert all(not getattr(p, "allreduce", True) for g in moe_groups for p in g["params"])
    assert all(getattr(p, "allreduce", True) for g in out if not g.get("moe") for p in g["params"])
    assert {(g["weight_decay"], g["lr_scale"]) for g in moe_groups} <= {(0.0, 1.0), (0.1, 0.5)}
    assert sum(len(g["params"]) for g in out) == len(params)
    assert optimizer_groups.split_params_into_moe_groups(out) == out  # already split: unchanged
    assert optimizer_groups.optimizer_param_groups(model, groups, tiny_cfg()) is groups  # reference backend
