"""The ``deepspeed`` MoE backend (smelt_ds/parallel/moe_backends/deepspeed_moe.py) against the reference
backend (docs/deepspeed_notes.md): conversion, capacity statistics and decoding, the fused experts against
DeepSpeed's loop, tutel, and expert parallelism 1 vs 2 on 2 gloo ranks (tiny model: backend_helpers.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from smelt_ds.errors import ConfigError  # noqa: E402
from smelt_ds.parallel import moe_backends  # noqa: E402
from smelt_ds.parallel.moe_backends import apply, deepspeed_moe  # noqa: E402
from smelt_ds.testing import run_distributed  # noqa: E402
from tests.numerics import assert_close_chain  # noqa: E402
from tests.parallel.moe_backends.backend_helpers import (  # noqa: E402
    MICRO,
    N_FWD,
    N_STEP,
    SEQ,
    TIMEOUT_S,
    WORLD,
    build,
    ds_config,
    expert_tensors,
    loss_tol,
    objective,
    reference_grads,
    shard_batches,
    tiny_cfg,
)


@pytest.mark.parametrize("top_k,norm,shared,dense", [(1, False, 0, 0), (2, True, 0, 0), (3, True, 0, 0),
                                                      (2, True, 8, 1)])
def test_deepspeed_conversion_matches_reference(top_k, norm, shared, dense):
    """Same weights, nothing dropped: forward, losses, gradients and router statistics equal."""
    model_over = {"first_k_dense": dense}
    ref = build(tiny_cfg(model_over, top_k=top_k, norm_topk_prob=norm, shared_expert_ffn_size=shared))
    cfg = tiny_cfg(model_over, backend="deepspeed", top_k=top_k, norm_topk_prob=norm,
                   shared_expert_ffn_size=shared, drop_tokens=False)
    model = moe_backends.apply_backend(copy.deepcopy(ref), cfg)
    assert [isinstance(b.mlp, deepspeed_moe.DeepSpeedMoE) for b in model.layers] == [i >= dense for i in range(4)]
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
        for e, g in expert_tensors(mlp, 0, "grad").items():
            want = torch.cat([ref_mlp.experts.gate_up_proj.grad[e], ref_mlp.experts.down_proj.grad[e].t()])
            assert_close_chain(g, want, N_STEP)
    route = model.recorder.routes[(1, 1)]  # second visit of a looped layer
    assert route.dropped_share == 0.0 and bool(route.kept_TK.all())
    assert model.recorder.router_stats()[(1, 1)] == ref.recorder.router_stats()[(1, 1)]


def test_deepspeed_backend_capacity_statistics_and_decode():
    cfg = tiny_cfg(backend="deepspeed", capacity_factor=0.5, min_capacity=1, drop_tokens=True)
    model = moe_backends.apply_backend(build(tiny_cfg()), cfg)
    ids = shard_batches(1, 0)[0]
    out = model(ids[:, :-1], labels=ids[:, 1:])
    T = MICRO * SEQ
    for route in model.recorder.routes.values():
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
        m = moe_backends.apply_backend(build(tiny_cfg(top_k=top_k, norm_topk_prob=norm)), dcfg)
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
    fused.__class__ = deepspeed_moe.smelt_fused_experts_class()  # what DeepSpeedMoE does to its layer's Experts
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
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2], strict=True))
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in loop.named_parameters()]
    assert all(p.allreduce is False and p.group_name == "ep_size_1" for p in fused.parameters())
    fused.zero_grad(set_to_none=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deepspeed_moe, "_use_bmm", lambda t: True)
        bmm = _run_experts(fused, x, g)
    n = H + F_ + (2 * F_ + H) + G * C  # gate/up and down forward, their input gradients, weights over rows
    for a, b in zip([bmm[0], bmm[1], *bmm[2]], [want[0], want[1], *want[2]], strict=True):
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
    model = moe_backends.apply_backend(build(tiny_cfg()), tiny_cfg(backend="deepspeed"))
    assert all(type(b.mlp.moe.deepspeed_moe.experts) is deepspeed_moe.smelt_fused_experts_class() for b in model.layers)


def test_use_tutel_without_tutel_is_a_config_error(monkeypatch):
    monkeypatch.setattr(apply, "tutel_available", lambda: False)  # the name check_backend_runtime calls
    cfg = tiny_cfg(backend="deepspeed", use_tutel=True)  # loads: whether tutel is installed is a runtime fact
    with pytest.raises(ConfigError, match=r"moe_runtime\.use_tutel.*`tutel`.*pip install"):
        moe_backends.apply_backend(build(tiny_cfg()), cfg)
    for backend in ("autoep", "reference"):  # refused when the recipe is read, not silently ignored
        with pytest.raises(ConfigError, match=rf"moe_runtime\.use_tutel.*only applies to moe_runtime.backend "
                                              rf"'deepspeed' \(this recipe: '{backend}'\)"):
            tiny_cfg(backend=backend, use_tutel=True)


def test_tutel_is_not_installed_here():
    """tutel is not installable on this machine: the real check (no monkeypatch) must refuse."""
    if deepspeed_moe.tutel_available():
        pytest.skip("tutel is installed")
    with pytest.raises(ConfigError, match=r"tutel"):
        moe_backends.check_backend_runtime(tiny_cfg(backend="deepspeed", use_tutel=True), zero_stage=2)


# ---------------------------------------------------------------------------------------------
# distributed: 2 gloo ranks
# ---------------------------------------------------------------------------------------------


def _deepspeed_ep_worker(rank: int, world: int) -> dict:
    """For ep_size 1 and 2: ZeRO-0 gradients after one backward, ZeRO-2 SGD(lr=1) update of one
    step, ZeRO-2 losses over 3 steps; then DeepSpeed's own ZeRO-3 refusal."""
    res = {}
    for ep in (1, 2):
        cfg = tiny_cfg(backend="deepspeed", ep_size=ep, drop_tokens=False)
        ep_rank = moe_backends.expert_parallel_rank(ep)
        for stage in (0, 2):
            model = moe_backends.apply_backend(build(cfg), cfg, zero_stage=stage)
            groups = moe_backends.optimizer_param_groups(
                model, [{"params": list(model.parameters()), "name": "all"}], cfg)
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(groups, lr=1.0),
                                              config=ds_config(stage))
            before = {i: expert_tensors(b.mlp, ep_rank, "data") for i, b in enumerate(model.layers)}
            losses, grads, delta = [], {}, {}
            for step, ids in enumerate(shard_batches(3 if stage else 1, rank)):
                out = engine(ids[:, :-1], labels=ids[:, 1:])
                engine.backward(objective(out))
                if stage == 0:
                    for i, b in enumerate(model.layers):
                        grads.update({(i, e): g for e, g in expert_tensors(b.mlp, ep_rank, "grad").items()})
                        grads[(i, "router")] = b.mlp.gate.wg.weight.grad.clone()
                engine.step()
                if stage == 2 and step == 0:
                    for i, b in enumerate(model.layers):
                        after = expert_tensors(b.mlp, ep_rank, "data")
                        delta.update({(i, e): after[e] - before[i][e] for e in after})
                losses.append(objective(out).item())
            res[(ep, stage)] = {"losses": losses, "grads": grads, "delta": delta}
    cfg = tiny_cfg(backend="deepspeed", ep_size=2, drop_tokens=False)
    model = moe_backends.apply_backend(build(cfg), cfg, zero_stage=2)  # our check passes at stage 2 ...
    try:  # ... and DeepSpeed itself refuses native MoE under ZeRO-3
        groups = moe_backends.split_params_into_moe_groups([{"params": list(model.parameters())}])
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
