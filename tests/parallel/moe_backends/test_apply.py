"""Applying a MoE backend (smelt_ds/parallel/moe_backends/apply.py): recipes a backend can never run
refused naming the field and the fix, the runtime checks, and every expert-parallel backend through
steps in which an expert gets no token (2 gloo ranks; tiny model: backend_helpers.py)."""

from __future__ import annotations

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from smelt_ds.config.loading import config_from_dict  # noqa: E402
from smelt_ds.errors import ConfigError  # noqa: E402
from smelt_ds.parallel import moe_backends  # noqa: E402
from smelt_ds.parallel.ds_config import expert_parallel_section  # noqa: E402
from smelt_ds.parallel.moe_backends import apply  # noqa: E402
from smelt_ds.testing import run_distributed  # noqa: E402
from tests.numerics import assert_close_chain  # noqa: E402
from tests.parallel.moe_backends.backend_helpers import (  # noqa: E402
    N_STEP,
    TIMEOUT_S,
    WORLD,
    build,
    ds_config,
    objective,
    shard_batches,
    tiny_cfg,
)


def test_config_errors_name_field_and_fix():
    """Recipes a backend can never run are refused when they are loaded (config validators);
    apply_backend reruns those rules for an explicit ZeRO stage and adds the runtime ones."""
    with pytest.raises(ConfigError, match=r"moe_runtime\.backend.*ZeRO stage 3.*autoep"):
        config_from_dict({"moe_runtime": {"backend": "deepspeed"}, "deepspeed": {"zero_stage": 3}})
    with pytest.raises(ConfigError, match=r"moe\.score_func.*softmax"):
        tiny_cfg(backend="deepspeed", score_func="sigmoid")
    with pytest.raises(ConfigError, match=r"moe\.norm_topk_prob.*false"):
        tiny_cfg(backend="deepspeed", top_k=1)
    cfg = tiny_cfg(backend="deepspeed")
    with pytest.raises(ConfigError, match=r"moe_runtime\.backend.*ZeRO stage 3.*autoep"):
        apply.check_backend_runtime(cfg, zero_stage=3)  # a DeepSpeed config other than the recipe's
    with pytest.raises(ConfigError, match=r"moe_runtime\.ep_size.*divide.*\(3\)"):
        apply.check_backend_runtime(tiny_cfg(backend="deepspeed", ep_size=2), zero_stage=1, world_size=3)
    apply.check_backend_runtime(cfg, zero_stage=2, world_size=2)  # valid


def test_num_experts_not_divisible_by_ep_size():
    for backend in ("deepspeed", "autoep"):
        with pytest.raises(ConfigError, match=r"moe\.num_experts.*\(6\).*divisible.*moe_runtime\.ep_size.*\(4\)"):
            config_from_dict({"moe": {"num_experts": 6}, "moe_runtime": {"backend": backend, "ep_size": 4}})


# ---------------------------------------------------------------------------------------------
# distributed: 2 gloo ranks
# ---------------------------------------------------------------------------------------------


def _zero_moe_inputs(rank: int) -> list[int]:
    """Layers whose MoE input ``_empty_expert_worker`` zeroes on ``rank``."""
    return [3] + ([1] if rank == 0 else [])


def _empty_expert_worker(rank: int, world: int) -> dict:
    """The MoE input of layer 1 is zero on rank 0 only, of layer 3 on both ranks: all its tokens
    tie and go to the same top-2 experts, so the other experts get no tokens from that rank
    (layer 3: from any rank). Two optimizer steps must complete; the gradients of the first
    backward are returned in the reference layout (``test_grad_norm.canonical``; this rank's
    experts)."""
    from tests.parallel.test_grad_norm import canonical, ep_rank_of, full_grad

    res = {}
    for backend, stage in (("deepspeed", 2), ("autoep", 3), ("autoep", 2)):
        cfg = tiny_cfg(backend=backend, ep_size=2, drop_tokens=False)
        model = build(cfg)
        for i in _zero_moe_inputs(rank):
            model.layers[i].post_attention_layernorm.register_forward_hook(lambda m, a, out: out * 0.0)
        model = moe_backends.apply_backend(model, cfg, zero_stage=stage)
        extra = {"expert_parallel": expert_parallel_section(cfg)} if backend == "autoep" else {}
        engine, *_ = deepspeed.initialize(
            model=model, config=ds_config(stage, **extra),
            model_parameters=moe_backends.optimizer_param_groups(
                model, [{"params": list(model.parameters()), "name": "all"}], cfg),
            optimizer=moe_backends.moe_optimizer(torch.optim.AdamW, lr=1e-2))
        losses, grads = [], None
        for ids in shard_batches(2, rank):
            out = engine(ids[:, :-1], labels=ids[:, 1:])
            engine.backward(objective(out))
            if grads is None:
                grads = canonical(model, full_grad, ep_rank_of(cfg))
            engine.step()
            losses.append(objective(out).item())
        stats = model.recorder.router_stats()
        res[(backend, stage)] = {"losses": losses, "layer1": stats[(1, 0)]["tokens_per_expert"],
                                 "layer3": stats[(3, 0)]["tokens_per_expert"], "grads": grads}
    return res


def _empty_expert_reference_grads() -> dict:
    """Single process, reference backend, same weights and zeroed inputs per shard: the
    shard-averaged gradients of the first global batch (``test_grad_norm.canonical`` layout)."""
    from tests.parallel.test_grad_norm import canonical

    model = build(tiny_cfg())
    zero_now: set[int] = set()
    for i in (1, 3):
        model.layers[i].post_attention_layernorm.register_forward_hook(
            lambda m, a, out, i=i: out * 0.0 if i in zero_now else out)
    for r in range(WORLD):
        zero_now.clear()
        zero_now.update(_zero_moe_inputs(r))
        ids = shard_batches(1, r)[0]
        (objective(model(ids[:, :-1], labels=ids[:, 1:])) / WORLD).backward()
    return canonical(model, lambda p: p.grad)


@pytest.mark.distributed
def test_empty_expert_no_hang():
    """Finite losses, and the gradients of the first step equal the single-process reference's
    (within 2 n u of each tensor's largest gradient, n = N_STEP); an expert that got no token from
    any rank has exactly zero gradients."""
    from tests.parallel.test_grad_norm import merge

    r0, r1 = run_distributed(_empty_expert_worker, world_size=WORLD, timeout=TIMEOUT_S)
    ref = _empty_expert_reference_grads()
    assert any(float(ref[(1, "expert", e)].abs().sum()) > 0 for e in range(4))  # not a vacuous comparison
    for key in r0:
        for r in (r0, r1):
            assert all(torch.isfinite(torch.tensor(r[key]["losses"]))), key
            assert min(r[key]["layer3"]) == 0, key  # some expert got no token from any rank
        assert min(r0[key]["layer1"]) == 0, key  # ... and on rank 0 only
        grads = merge([r0[key]["grads"], r1[key]["grads"]])
        assert set(grads) == set(ref), key
        for name, want in ref.items():
            assert_close_chain(grads[name], want, N_STEP, msg=lambda m, key=key, name=name: f"{key} {name}: {m}")
        empty = [e for e in range(4) if r0[key]["layer3"][e] + r1[key]["layer3"][e] == 0]
        assert empty, key
        for e in empty:
            assert torch.count_nonzero(grads[(3, "expert", e)]) == 0, (key, e)
