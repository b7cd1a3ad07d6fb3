"""MoE backends (``deepspeed``, ``autoep``) against the reference backend (DESIGN §4).

Tiny model everywhere: hidden 32, 4 unique layers with the middle two looped (plan 0 1 2 1 2 3),
4 experts, top-2, expert size 16, sequences of 16 tokens, micro-batch 2 per rank. Distributed
tests spawn 2 real gloo ranks through :func:`smelt_ds.testing.run_distributed`; the reference is
a single process that runs each rank's shard of the same global batch and averages the losses
(what data parallelism computes, the aux loss included: it is per rank in both).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from smelt_ds.config.loading import config_from_dict  # noqa: E402
from smelt_ds.config.moe import MoERuntimeConfig  # noqa: E402
from smelt_ds.config.train import TrainConfig  # noqa: E402
from smelt_ds.errors import ConfigError  # noqa: E402
from smelt_ds.model import SmeltLM  # noqa: E402
from smelt_ds.parallel import moe_backends as mb  # noqa: E402
from smelt_ds.parallel.ds_config import expert_parallel_section  # noqa: E402
from smelt_ds.testing import run_distributed  # noqa: E402
from smelt_ds.train.objective import total_loss  # noqa: E402
from tests.numerics import assert_close_chain, lm_chain_length, prob_tol  # noqa: E402

VOCAB, SEQ, MICRO, WORLD = 64, 16, 2, 2
TIMEOUT_S = 240  # the first DeepSpeed start on a machine JIT-builds its CPU comm op (about a minute)
TRAIN_CFG = TrainConfig(seq_len=SEQ, micro_batch_size=MICRO)  # aux / z coefficients: the defaults


def tiny_cfg(model: dict | None = None, **moe):
    """``moe`` keywords go to ``moe:`` (architecture) or ``moe_runtime:`` (backend, ep_size, ...)."""
    runtime = {k: moe.pop(k) for k in list(moe) if k in MoERuntimeConfig.model_fields}
    raw = {"model": {"vocab_size": VOCAB, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                     "max_seq_len": 32, **(model or {})},
           "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16, **moe}, "moe_runtime": runtime,
           "loop": {"position": "middle"}, "train": {"seq_len": SEQ, "micro_batch_size": MICRO}}
    return config_from_dict(raw)


# Tolerances (tests/numerics.py): other kernels compute the same sums in other orders. Tensors
# element-wise within 2 n u of their largest reference value, n the reduction lengths on the longest
# path (lm_chain_length): forward only 1652 (logits: 2.0e-4), forward and backward with a weight
# gradient summed over a micro-batch x 2 visits x 2 shards 3520 (gradients: 4.2e-4). Scalar losses
# (means of positive terms) relative to themselves by Higham & Mary's probabilistic bound over the
# whole chain: 7.1e-5 after one forward and backward pass, 1.2e-4 after three steps.
N_FWD = lm_chain_length(tiny_cfg(), tokens=0, backward=False)
N_STEP = lm_chain_length(tiny_cfg(), tokens=MICRO * SEQ * 2 * WORLD)


def loss_tol(steps: int = 1) -> float:
    """Relative tolerance of a loss after ``steps`` forward/backward passes in another order."""
    return prob_tol(steps * N_STEP)


def objective(out) -> torch.Tensor:
    """The training objective of these tests (default loss coefficients)."""
    return total_loss(out, TRAIN_CFG)


def shard_batches(steps: int, rank: int, world: int = WORLD) -> list[torch.Tensor]:
    """Rank ``rank``'s ``(MICRO, SEQ + 1)`` slice of each global batch (same on every call)."""
    g = torch.Generator().manual_seed(123)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (MICRO * world, SEQ + 1), generator=g)
        out.append(ids[MICRO * rank: MICRO * (rank + 1)])
    return out


def build(cfg, seed: int = 0) -> SmeltLM:
    torch.manual_seed(seed)
    return SmeltLM(cfg.model, cfg.moe, cfg.loop)


def ds_config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, **extra}


def reference_run(cfg, steps: int, lr: float = 1e-2, ckpt: bool = False) -> list[list[tuple[float, float, float]]]:
    """Single process: per step, ``[(loss, aux, z) of rank 0's shard, ... of rank 1's shard]``,
    gradients averaged over the shards, then an AdamW step."""
    model = build(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    shards = [shard_batches(steps, r) for r in range(WORLD)]
    out = []
    for s in range(steps):
        opt.zero_grad()
        row = []
        for r in range(WORLD):
            ids = shards[r][s]
            o = model(ids[:, :-1], labels=ids[:, 1:])
            (objective(o) / WORLD).backward()
            row.append((objective(o).item(), o.aux_loss.item(), o.z_loss.item()))
        opt.step()
        out.append(row)
    return out


def reference_grads(cfg) -> tuple[list[float], dict]:
    """Single process, first global batch: per-shard losses and the shard-averaged gradients of
    every router and expert, keyed ``(layer, "router")`` / ``(layer, expert)``; an expert's
    gradient is ``cat(d gate_proj, d up_proj, d down_proj^T)`` of shape ``(3F, H)``."""
    model = build(cfg)
    losses = []
    for r in range(WORLD):
        ids = shard_batches(1, r)[0]
        o = model(ids[:, :-1], labels=ids[:, 1:])
        (objective(o) / WORLD).backward()
        losses.append(objective(o).item())
    grads = {}
    for i, block in enumerate(model.layers):
        grads[(i, "router")] = block.mlp.gate.weight.grad
        for e in range(cfg.moe.num_experts):
            grads[(i, e)] = torch.cat([block.mlp.experts.gate_up_proj.grad[e], block.mlp.experts.down_proj.grad[e].t()])
    return losses, grads


def _expert_tensors(mlp: "mb.DeepSpeedMoE", ep_rank: int, attr: str) -> dict:
    """``{(global expert): cat(gate, up, down^T)}`` of a DeepSpeedMoE's local experts (``attr`` =
    ``"grad"`` or ``"data"``)."""
    first = ep_rank * (mlp.num_experts // mlp.ep_size)
    return {first + j: torch.cat([getattr(e.gate_proj.weight, attr), getattr(e.up_proj.weight, attr),
                                  getattr(e.down_proj.weight, attr).t()]).detach().clone()
            for j, e in enumerate(mlp.local_experts)}


# ---------------------------------------------------------------------------------------------
# single process: conversion equivalence, statistics, validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k,norm,shared,dense", [(1, False, 0, 0), (2, True, 0, 0), (3, True, 0, 0),
                                                      (2, True, 8, 1)])
def test_deepspeed_conversion_matches_reference(top_k, norm, shared, dense):
    """Same weights, nothing dropped: forward, losses, gradients and router statistics equal."""
    model_over = {"first_k_dense": dense}
    ref = build(tiny_cfg(model_over, top_k=top_k, norm_topk_prob=norm, shared_expert_ffn_size=shared))
    cfg = tiny_cfg(model_over, backend="deepspeed", top_k=top_k, norm_topk_prob=norm,
                   shared_expert_ffn_size=shared, drop_tokens=False)
    model = mb.apply_backend(copy.deepcopy(ref), cfg)
    assert [isinstance(b.mlp, mb.DeepSpeedMoE) for b in model.layers] == [i >= dense for i in range(4)]
    ids = shard_batches(1, 0)[0]
    a, b = ref(ids[:, :-1], labels=ids[:, 1:]), model(ids[:, :-1], labels=ids[:, 1:])
    assert_close_chain(b.logits, a.logits, N_FWD)
    for name in ("lm_loss", "aux_loss", "z_loss"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=loss_tol(), atol=0.0)
    objective(a).backward()
    objective(b).backward()
    for i in range(dense, 4):
        ref_mlp, mlp = ref.layers[i].mlp, model.layers[i].mlp
        assert_close_chain(mlp.gate.wg.weight.grad, ref_mlp.gate.weight.grad, N_STEP)
        for e, g in _expert_tensors(mlp, 0, "grad").items():
            want = torch.cat([ref_mlp.experts.gate_up_proj.grad[e], ref_mlp.experts.down_proj.grad[e].t()])
            assert_close_chain(g, want, N_STEP)
    route = model.recorder.routes[(1, 1)]  # second visit of a looped layer
    assert route.dropped_share == 0.0 and bool(route.kept_TK.all())
    assert model.recorder.router_stats()[(1, 1)] == ref.recorder.router_stats()[(1, 1)]


def test_deepspeed_backend_capacity_statistics_and_decode():
    cfg = tiny_cfg(backend="deepspeed", capacity_factor=0.5, min_capacity=1, drop_tokens=True)
    model = mb.apply_backend(build(tiny_cfg()), cfg)
    ids = shard_batches(1, 0)[0]
    out = model(ids[:, :-1], labels=ids[:, 1:])
    T = MICRO * SEQ
    for visit, route in model.recorder.routes.items():
        assert route.capacity == math.ceil(T / 4 * 0.5 * 2)  # ceil(T / E * capacity_factor * k)
        kept_per_expert = torch.bincount(route.topk_idx_TK[route.kept_TK], minlength=4)
        assert int(kept_per_expert.max()) <= route.capacity
        assert 0.0 < route.dropped_share < 1.0
        assert sum(route.tokens_per_expert()) == T * 2  # choices before dropping
        assert route.ds_l_aux is not None and not route.ds_l_aux.requires_grad
    gate = model.layers[3].mlp.gate  # its last call is the last visit: (3, 0)
    dispatched_TK = gate.last_gate_out[3].t().long()  # DeepSpeed's [K, T] experts, -1 = dropped
    route = model.recorder.routes[(3, 0)]
    assert torch.equal(dispatched_TK >= 0, route.kept_TK)
    assert torch.equal(dispatched_TK[route.kept_TK], route.topk_idx_TK[route.kept_TK])
    assert torch.isfinite(objective(out))
    # a 1-token decode step (T = batch < min_capacity) must not trip top1gating's assert
    for top_k, norm in ((1, False), (2, True)):
        dcfg = tiny_cfg(backend="deepspeed", top_k=top_k, norm_topk_prob=norm, min_capacity=4)
        m = mb.apply_backend(build(tiny_cfg(top_k=top_k, norm_topk_prob=norm)), dcfg)
        assert m.generate(ids[:1, :4], max_new_tokens=3).shape == (1, 7)


def _experts_pair(G: int, E: int, C: int, H: int, F_: int):
    """DeepSpeed's own ``Experts`` (its per-expert loop) and a copy switched to the fused class,
    the same random weights, and an input ``(G, E, C, H)`` whose last two capacity rows are
    zero (unfilled slots) plus an upstream gradient."""
    from deepspeed.moe.experts import Experts

    from smelt_ds.model.experts import SwiGLU

    torch.manual_seed(G * 100 + E)
    loop = Experts(SwiGLU(H, F_), E, expert_group_name="ep_size_1")
    for p in loop.parameters():
        torch.nn.init.normal_(p, std=0.2)
    fused = Experts(SwiGLU(H, F_), E, expert_group_name="ep_size_1")  # sets DeepSpeed's expert attributes
    fused.load_state_dict(loop.state_dict())
    fused.__class__ = mb.smelt_fused_experts_class()  # what DeepSpeedMoE does to its layer's Experts
    x = torch.randn(G, E, C, H)
    x[:, :, -2:] = 0.0
    return loop, fused, x, torch.randn(G, E, C, H)


def _run_experts(experts, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    x = x.clone().requires_grad_(True)
    y = experts(x)
    (y * g).sum().backward()
    return y.detach(), x.grad, [p.grad for p in experts.parameters()]


@pytest.mark.parametrize("G,E,C,H,F_", [(1, 6, 9, 32, 16), (2, 4, 5, 24, 20)])
def test_fused_experts_equal_deepspeed_experts_loop(G, E, C, H, F_):
    """The deepspeed backend's experts (one autograd node) against DeepSpeed's ``Experts`` loop of
    nn.Linear modules: output, input and weight gradients bit for bit on CPU (the same
    ``torch.mm`` per expert; G = 2 is the layout after an expert-parallel all-to-all); the
    non-CPU path (one ``torch.bmm`` per projection, forced here) to fp32 rounding; parameters,
    names and DeepSpeed's expert attributes unchanged."""
    loop, fused, x, g = _experts_pair(G, E, C, H, F_)
    want = _run_experts(loop, x, g)
    got = _run_experts(fused, x, g)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in loop.named_parameters()]
    assert all(p.allreduce is False and p.group_name == "ep_size_1" for p in fused.parameters())
    fused.zero_grad(set_to_none=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mb, "_use_bmm", lambda t: True)
        bmm = _run_experts(fused, x, g)
    n = H + F_ + (2 * F_ + H) + G * C  # gate/up and down forward, their input gradients, weights over rows
    for a, b in zip([bmm[0], bmm[1], *bmm[2]], [want[0], want[1], *want[2]]):
        assert_close_chain(a, b, n)


def test_fused_experts_save_no_weight_copies_and_are_used():
    """Activation memory: the fused node saves no more non-parameter elements than DeepSpeed's
    loop (stacked weight copies would add 3 E F H); every DeepSpeedMoE layer uses the fused class."""
    loop, fused, x, g = _experts_pair(1, 6, 9, 32, 16)
    weights = {p.data_ptr() for p in [*loop.parameters(), *fused.parameters()]}

    def saved_elements(experts) -> int:
        saved: dict[int, int] = {}  # data pointer -> elements (two views of one tensor count once)

        def pack(t):
            if t.data_ptr() not in weights:  # a weight or a view of one (w.t()) is not a copy
                saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            experts(x.clone().requires_grad_(True))
        return sum(saved.values())

    E, C, H, F_ = 6, 9, 32, 16
    assert saved_elements(fused) == E * C * (H + 2 * F_)  # x and the two projections
    assert saved_elements(loop) == E * C * (H + 4 * F_)  # also silu(gate) and the product
    model = mb.apply_backend(build(tiny_cfg()), tiny_cfg(backend="deepspeed"))
    assert all(type(b.mlp.moe.deepspeed_moe.experts) is mb.smelt_fused_experts_class() for b in model.layers)


@pytest.mark.parametrize("score_func,shared,dense", [("softmax", 0, 0), ("sigmoid", 8, 1)])
def test_autoep_conversion_matches_reference(score_func, shared, dense):
    """AutoEP's own detection + replacement (ep_size 1, no process group) on our model."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import (
        parse_autoep_config,
        validate_autoep_config,
        validate_autoep_post_detection,
    )

    cfg = tiny_cfg({"first_k_dense": dense}, backend="autoep", score_func=score_func, shared_expert_ffn_size=shared)
    ref = build(cfg)
    model = mb.apply_backend(copy.deepcopy(ref), cfg)
    conf = parse_autoep_config(expert_parallel_section(cfg))
    validate_autoep_config(conf, world_size=2, pp_size=1, tp_size=1, sp_size=1)
    auto_ep = AutoEP(model, conf)
    specs = auto_ep.ep_parser()
    validate_autoep_post_detection(conf, specs)
    assert [s.moe_module_name for s in specs] == [f"layers.{i}.mlp" for i in range(dense, 4)]  # dense skipped
    s = specs[0]
    assert (s.num_experts, s.top_k, s.hidden_size, s.ffn_hidden_size, s.score_func, s.route_norm) == \
        (4, 2, 32, 16, score_func, True)
    assert s.has_shared_experts == bool(shared)
    auto_ep.replace_moe_layers(specs, ep_size=1, ep_rank=0)
    assert len(mb.autoep_layers(model)) == 4 - dense
    ids = shard_batches(1, 0)[0]
    a, b = ref(ids[:, :-1], labels=ids[:, 1:]), model(ids[:, :-1], labels=ids[:, 1:])
    assert_close_chain(b.logits, a.logits, N_FWD)
    for name in ("lm_loss", "aux_loss", "z_loss"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=loss_tol(), atol=0.0)
    assert model.recorder.router_stats() == ref.recorder.router_stats()
    assert b.aux_loss.requires_grad and b.z_loss.requires_grad


def test_split_params_into_moe_groups_keeps_group_options():
    cfg = tiny_cfg(backend="deepspeed")
    model = mb.apply_backend(build(tiny_cfg()), cfg)
    params = list(model.parameters())
    groups = [{"params": params[:5], "weight_decay": 0.0, "lr_scale": 1.0},
              {"params": params[5:], "weight_decay": 0.1, "lr_scale": 0.5, "name": "decay"}]
    out = mb.optimizer_param_groups(model, groups, cfg)
    moe_groups = [g for g in out if g.get("moe")]
    assert moe_groups and all(g["name"] == "ep_size_1" for g in moe_groups)
    assert all(not getattr(p, "allreduce", True) for g in moe_groups for p in g["params"])
    assert all(getattr(p, "allreduce", True) for g in out if not g.get("moe") for p in g["params"])
    assert {(g["weight_decay"], g["lr_scale"]) for g in moe_groups} <= {(0.0, 1.0), (0.1, 0.5)}
    assert sum(len(g["params"]) for g in out) == len(params)
    assert mb.split_params_into_moe_groups(out) == out  # already split: unchanged
    assert mb.optimizer_param_groups(model, groups, tiny_cfg()) is groups  # reference backend


def test_config_errors_name_field_and_fix():
    """Recipes a backend can never run are refused when they are loaded (config validators);
    apply_backend reruns those rules for an explicit ZeRO stage and adds the runtime ones."""
    with pytest.raises(ConfigError, match=r"moe_runtime\.backend.*ZeRO stage 3.*autoep"):
        config_from_dict({"moe_runtime": {"backend": "deepspeed"}, "deepspeed": {"zero_stage": 3}})
    with pytest.raises(ConfigError, match=r"moe_runtime\.backend.*ZeRO stage 3.*autoep"):  # passed-through keys
        config_from_dict({"moe_runtime": {"backend": "deepspeed"},
                          "deepspeed": {"config": {"zero_optimization": {"stage": 3}}}})
    with pytest.raises(ConfigError, match=r"moe\.score_func.*softmax"):
        tiny_cfg(backend="deepspeed", score_func="sigmoid")
    with pytest.raises(ConfigError, match=r"moe\.norm_topk_prob.*false"):
        tiny_cfg(backend="deepspeed", top_k=1)
    cfg = tiny_cfg(backend="deepspeed")
    with pytest.raises(ConfigError, match=r"moe_runtime\.backend.*ZeRO stage 3.*autoep"):
        mb.check_backend_runtime(cfg, zero_stage=3)  # a DeepSpeed config other than the recipe's
    with pytest.raises(ConfigError, match=r"moe_runtime\.ep_size.*divide.*\(3\)"):
        mb.check_backend_runtime(tiny_cfg(backend="deepspeed", ep_size=2), zero_stage=1, world_size=3)
    mb.check_backend_runtime(cfg, zero_stage=2, world_size=2)  # valid


def test_use_tutel_without_tutel_is_a_config_error(monkeypatch):
    monkeypatch.setattr(mb, "tutel_available", lambda: False)
    cfg = tiny_cfg(backend="deepspeed", use_tutel=True)  # loads: whether tutel is installed is a runtime fact
    with pytest.raises(ConfigError, match=r"moe_runtime\.use_tutel.*`tutel`.*pip install"):
        mb.apply_backend(build(tiny_cfg()), cfg)
    for backend in ("autoep", "reference"):  # refused when the recipe is read, not silently ignored
        with pytest.raises(ConfigError, match=rf"moe_runtime\.use_tutel.*only applies to moe_runtime.backend "
                                              rf"'deepspeed' \(this recipe: '{backend}'\)"):
            tiny_cfg(backend=backend, use_tutel=True)


def test_tutel_is_not_installed_here():
    """tutel is not installable on this machine: the real check (no monkeypatch) must refuse."""
    if mb.tutel_available():
        pytest.skip("tutel is installed")
    with pytest.raises(ConfigError, match=r"tutel"):
        mb.check_backend_runtime(tiny_cfg(backend="deepspeed", use_tutel=True), zero_stage=2)


def test_autoep_rejects_what_autoep_rejects():
    with pytest.raises(ConfigError, match=r"moe\.aux_loss_free_bias.*'autoep'.*load_balance_coeff"):
        config_from_dict({"moe": {"aux_loss_free_bias": True}, "moe_runtime": {"backend": "autoep"}})
    with pytest.raises(ConfigError, match=r"moe\.aux_loss_free_bias.*'deepspeed'.*expert bias"):
        config_from_dict({"moe": {"aux_loss_free_bias": True}, "moe_runtime": {"backend": "deepspeed"}})
    with pytest.raises(ConfigError, match=r"moe\.router_jitter"):
        tiny_cfg(backend="autoep", router_jitter=0.01)
    cfg = tiny_cfg(backend="autoep")
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    with pytest.raises(ValueError, match="load_balance_coeff"):  # what DeepSpeed itself does
        parse_autoep_config({**expert_parallel_section(cfg), "load_balance_coeff": 1e-3})


def test_num_experts_not_divisible_by_ep_size():
    for backend in ("deepspeed", "autoep"):
        with pytest.raises(ConfigError, match=r"moe\.num_experts.*\(6\).*divisible.*moe_runtime\.ep_size.*\(4\)"):
            config_from_dict({"moe": {"num_experts": 6}, "moe_runtime": {"backend": backend, "ep_size": 4}})


# ---------------------------------------------------------------------------------------------
# distributed: 2 gloo ranks
# ---------------------------------------------------------------------------------------------


def _deepspeed_ep_worker(rank: int, world: int) -> dict:
    """For ep_size 1 and 2: ZeRO-0 gradients after one backward, ZeRO-2 SGD(lr=1) update of one
    step, ZeRO-2 losses over 3 steps; then DeepSpeed's own ZeRO-3 refusal."""
    res = {}
    for ep in (1, 2):
        cfg = tiny_cfg(backend="deepspeed", ep_size=ep, drop_tokens=False)
        ep_rank = mb.expert_parallel_rank(ep)
        for stage in (0, 2):
            model = mb.apply_backend(build(cfg), cfg, zero_stage=stage)
            groups = mb.optimizer_param_groups(model, [{"params": list(model.parameters()), "name": "all"}], cfg)
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(groups, lr=1.0),
                                              config=ds_config(stage))
            before = {i: _expert_tensors(b.mlp, ep_rank, "data") for i, b in enumerate(model.layers)}
            losses, grads, delta = [], {}, {}
            for step, ids in enumerate(shard_batches(3 if stage else 1, rank)):
                out = engine(ids[:, :-1], labels=ids[:, 1:])
                engine.backward(objective(out))
                if stage == 0:
                    for i, b in enumerate(model.layers):
                        grads.update({(i, e): g for e, g in _expert_tensors(b.mlp, ep_rank, "grad").items()})
                        grads[(i, "router")] = b.mlp.gate.wg.weight.grad.clone()
                engine.step()
                if stage == 2 and step == 0:
                    for i, b in enumerate(model.layers):
                        after = _expert_tensors(b.mlp, ep_rank, "data")
                        delta.update({(i, e): after[e] - before[i][e] for e in after})
                losses.append(objective(out).item())
            res[(ep, stage)] = {"losses": losses, "grads": grads, "delta": delta}
    cfg = tiny_cfg(backend="deepspeed", ep_size=2, drop_tokens=False)
    model = mb.apply_backend(build(cfg), cfg, zero_stage=2)  # our check passes at stage 2 ...
    try:  # ... and DeepSpeed itself refuses native MoE under ZeRO-3
        groups = mb.split_params_into_moe_groups([{"params": list(model.parameters())}])
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(groups, lr=0.1), config=ds_config(3))
        res["zero3"] = None
    except AssertionError as e:
        res["zero3"] = str(e)
    return res


@pytest.mark.distributed
def test_deepspeed_backend_ep1_vs_ep2_same_loss_and_expert_grads():
    r0, r1 = run_distributed(_deepspeed_ep_worker, world_size=WORLD, timeout=TIMEOUT_S)
    ref_losses, ref_grads = reference_grads(tiny_cfg())
    for ep in (1, 2):
        for stage in (0, 2):
            assert [r0[(ep, stage)]["losses"][0], r1[(ep, stage)]["losses"][0]] == pytest.approx(ref_losses,
                                                                                                  rel=loss_tol())
        grads = {**r0[(ep, 0)]["grads"], **r1[(ep, 0)]["grads"]}  # ep 2: each rank holds half the experts
        delta = {**r0[(ep, 2)]["delta"], **r1[(ep, 2)]["delta"]}
        assert set(grads) == set(ref_grads)
        for key, want in ref_grads.items():
            assert_close_chain(grads[key], want, N_STEP, msg=f"ep {ep} grad {key}")
            if key[1] != "router":  # SGD lr=1 under ZeRO-2: the update is minus the averaged gradient; the
                # rounding of w - g adds u |w| <= 1e-8 (init std 0.02), 1/40 of the gradient tolerance
                assert_close_chain(delta[key], -want, N_STEP, msg=f"ep {ep} step {key}")
    for r in (r0, r1):  # 3 ZeRO-2 steps: same losses for ep 1 and 2
        assert r[(2, 2)]["losses"] == pytest.approx(r[(1, 2)]["losses"], rel=loss_tol(3))
    assert r0["zero3"] and "not supported with ZeRO Stage 3" in r0["zero3"]


def _autoep_worker(rank: int, world: int, steps: int) -> dict:
    """AutoEP, ZeRO-3, autoep_size 2, client AdamW passed as a callable; without and with
    non-reentrant activation checkpointing of every visit."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint

    res = {}
    for ckpt in (False, True):
        cfg = tiny_cfg(backend="autoep", ep_size=2)
        model = mb.apply_backend(build(cfg), cfg, zero_stage=3)
        if ckpt:
            model.blocks.configure_checkpointing(lambda visit: True, non_reentrant_checkpoint)
        engine, *_ = deepspeed.initialize(
            model=model, config=ds_config(3, expert_parallel=expert_parallel_section(cfg)),
            model_parameters=[{"params": list(model.parameters()), "name": "all"}],
            optimizer=mb.moe_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.0))
        rows = []
        for ids in shard_batches(steps, rank):
            out = engine(ids[:, :-1], labels=ids[:, 1:])
            engine.backward(objective(out))
            engine.step()
            rows.append((objective(out).item(), out.aux_loss.item(), out.z_loss.item()))
        layers = mb.autoep_layers(model)
        res[ckpt] = {"rows": rows, "layers": [(n, l.num_local_experts, l.ep_size) for n, l in layers],
                     "local_w1": tuple(getattr(layers[0][1].experts.w1, "ds_shape", layers[0][1].experts.w1.shape))}
    return res


@pytest.mark.distributed
def test_autoep_zero3_matches_reference():
    """Same loss, aux and z loss per rank over 3 optimizer steps as the single-process reference,
    within ``loss_tol(step)`` (7.1e-5 .. 1.2e-4 relative: 4.2e-4 absolute at step 2 for a loss of
    4.2). Losing the aux/z gradient (as reentrant checkpointing does) moves the step-2 loss by 6e-4,
    so the tolerance still catches it (narrowly; ``test_activation_checkpointing`` also catches it
    in the router gradient)."""
    steps = 3
    r0, r1 = run_distributed(_autoep_worker, world_size=WORLD, timeout=TIMEOUT_S, args=(steps,))
    ref = reference_run(tiny_cfg(), steps)
    for ckpt in (False, True):
        assert r0[ckpt]["layers"] == [(f"layers.{i}.mlp", 2, 2) for i in range(4)]
        assert r0[ckpt]["local_w1"] == (2, 16, 32)  # 2 of the 4 experts per rank: [E/ep, F, H]
        for s in range(steps):
            for r, res in enumerate((r0, r1)):
                assert res[ckpt]["rows"][s] == pytest.approx(ref[s][r], rel=loss_tol(s + 1)), (ckpt, s, r)


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
        model = mb.apply_backend(model, cfg, zero_stage=stage)
        extra = {"expert_parallel": expert_parallel_section(cfg)} if backend == "autoep" else {}
        engine, *_ = deepspeed.initialize(
            model=model, config=ds_config(stage, **extra),
            model_parameters=mb.optimizer_param_groups(model, [{"params": list(model.parameters()), "name": "all"}],
                                                       cfg),
            optimizer=mb.moe_optimizer(torch.optim.AdamW, lr=1e-2))
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
    (within 2 n u of each tensor's largest gradient, n = N_STEP); an expert that got no token from any rank has exactly zero
    gradients."""
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
            assert_close_chain(grads[name], want, N_STEP, msg=lambda m, name=name: f"{key} {name}: {m}")
        empty = [e for e in range(4) if r0[key]["layer3"][e] + r1[key]["layer3"][e] == 0]
        assert empty, key
        for e in empty:
            assert torch.count_nonzero(grads[(3, "expert", e)]) == 0, (key, e)


def _raise_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    torch.distributed.barrier()  # rank 0 waits for a peer that died: must not hang the test
    return rank


def _sleep_on_rank_0(rank: int, world: int) -> int:
    if rank == 0:
        import time

        time.sleep(600)
    return rank


@pytest.mark.distributed
def test_run_distributed_propagates_errors_and_times_out(monkeypatch):
    from smelt_ds.testing import DistributedTestError, scaled_timeout

    monkeypatch.setenv("SMELT_TEST_TIMEOUT_SCALE", "1")  # this test waits the whole limit: keep it 30 s in CI

    with pytest.raises(DistributedTestError, match=r"(?s)failed on ranks.*--- rank 1 ---.*ValueError: boom on rank 1"):
        run_distributed(_raise_on_rank_1, world_size=2, timeout=60, init_deepspeed=False)
    # 30 s (times SMELT_TEST_TIMEOUT_SCALE) leaves a loaded machine time to start both ranks; rank 0
    # sleeps 600 s, so it must be the one reported (rank 1 returns at once once it is up)
    with pytest.raises(DistributedTestError, match=rf"timed out after {scaled_timeout(30):g} s \(timeout=30 s x "
                       r"SMELT_TEST_TIMEOUT_SCALE=[0-9.e+-]+\); ranks without a result: \[0\]"):
        run_distributed(_sleep_on_rank_0, world_size=2, timeout=30, init_deepspeed=False)
