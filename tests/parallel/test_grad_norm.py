"""Global gradient norm and clipping with expert parallelism (``smelt_ds/parallel/grad_norm.py``), against a
single-process reference.

Tiny model (hidden 32, 4 unique layers, middle two looped, 4 experts, top-2, expert size 16),
2 gloo ranks, micro-batch 2 of 16 tokens per rank. The reference is one process running the
reference backend on the same weights and both ranks' micro-batches (the loss of each shard
divided by 2, as data parallelism averages gradients), clipping the global norm to ``CLIP`` and
taking an SGD step: ``w - LR * min(1, CLIP / (||g|| + 1e-6)) * g``. SGD makes the update linear
in the clipped gradient, so a wrong clipping norm shows up 1:1 in the parameters (AdamW's first
step is nearly invariant to the gradient's scale and would hide it).

Each distributed case builds its engine like the training loop does (``build_ds_config`` from
the recipe, so the ``ds_configs/`` templates and ``gradient_clipping`` as written by
:func:`smelt_ds.parallel.grad_norm.deepspeed_gradient_clipping`), runs one forward/backward, then
``smelt_ds.train.loop._grad_norm_before_step`` (norm; clipping at ZeRO-0 with an EP backend),
``engine.step()`` and ``smelt_ds.train.loop._grad_norm`` (the logged value).

Tolerances (fp32, different reduction orders): norms 1e-5 relative (observed <= 1e-7);
gradients 1e-4 relative + 1e-8 absolute per element (observed per-tensor relative errors
<= 4e-7; expert gradients are ~1e-4..1e-3); updates 2e-5 relative per tensor and as a whole
(observed whole-update error <= 2e-7).
DeepSpeed 0.19.8's own ZeRO-0 clipping is off by 2.9e-4 in the norm and update here (experts hold
0.1% of the squared norm of this model), so the tolerances catch it.
"""

from __future__ import annotations

import math

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from smelt_ds.config.run import config_from_dict  # noqa: E402
from smelt_ds.errors import ConfigError  # noqa: E402
from smelt_ds.model import SmeltLM  # noqa: E402
from smelt_ds.parallel import grad_norm as gn  # noqa: E402
from smelt_ds.testing import run_distributed  # noqa: E402
from smelt_ds.train.objective import total_loss  # noqa: E402

VOCAB, SEQ, MICRO, WORLD, EP = 64, 16, 2, 2, 2
CLIP = 0.05  # the reference norm is 1.445: the step is clipped by 0.0346
LR = 10.0  # SGD; update norm LR * CLIP = 0.5 over 41760 weights
TIMEOUT_S = 420
NORM_RTOL, GRAD_RTOL, GRAD_ATOL, UPDATE_RTOL = 1e-5, 1e-4, 1e-8, 2e-5

#: (backend, ZeRO stage) of the distributed cases; run in this order in one pair of processes
#: (the reference backend last, so that it runs after expert groups exist: a control for leaks).
CASES = ([("deepspeed", s) for s in (0, 1, 2)] + [("autoep", s) for s in (0, 1, 2, 3)]
         + [("reference", s) for s in (0, 1, 2, 3)])


def make_cfg(backend: str = "reference", stage: int = 0, ep: int = EP, grad_clip: float = CLIP, **deepspeed_kw):
    moe = {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16}
    runtime: dict = {"backend": backend}
    if backend != "reference":
        runtime.update(ep_size=ep, drop_tokens=False)
    raw = {"name": "gn", "model": {"vocab_size": VOCAB, "hidden_size": 32, "num_layers": 4, "num_heads": 4,
                                   "num_kv_heads": 2, "max_seq_len": 32},
           "moe": moe, "moe_runtime": runtime, "loop": {"position": "middle"},
           "train": {"seq_len": SEQ, "micro_batch_size": MICRO, "gradient_accumulation_steps": 1,
                     "grad_clip": grad_clip, "precision": "fp32"},
           "deepspeed": {"zero_stage": stage, **deepspeed_kw}}
    return config_from_dict(raw)


def shard(rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``(MICRO, SEQ + 1)`` slice of the global batch (same on every call)."""
    g = torch.Generator().manual_seed(123)
    return torch.randint(0, VOCAB, (MICRO * WORLD, SEQ + 1), generator=g)[MICRO * rank: MICRO * (rank + 1)]


def build(cfg, seed: int = 0) -> SmeltLM:
    torch.manual_seed(seed)
    return SmeltLM(cfg.model, cfg.moe, cfg.loop)


def canonical(model, get, ep_rank: int = 0) -> dict:
    """Every weight (or gradient) of ``model`` in the reference layout, as fp32 copies.

    Keys: parameter names of the reference model for everything but the MoE experts
    (``layers.{i}.mlp.gate.weight`` is the router ``[E, H]`` for every backend), and
    ``(layer, "expert", e)`` for global expert ``e``: ``cat(gate [F, H], up [F, H], down^T [F, H])``
    of shape ``(3F, H)``. Only this rank's experts for the EP backends (``ep_rank`` picks their
    global ids). ``get(param) -> tensor`` reads the value (``.data``, or a full gradient).
    """
    from smelt_ds.parallel.moe_backends import DeepSpeedMoE

    out, moe_prefixes = {}, []
    for i, block in enumerate(model.layers):
        if not getattr(block, "is_moe", False):
            continue
        mlp, pre = block.mlp, f"layers.{i}.mlp."
        moe_prefixes.append(pre)
        if isinstance(mlp, DeepSpeedMoE):
            out[pre + "gate.weight"] = get(mlp.gate.wg.weight)
            first = ep_rank * (mlp.num_experts // mlp.ep_size)
            for j, ex in enumerate(mlp.local_experts):
                out[(i, "expert", first + j)] = torch.cat(
                    [get(ex.gate_proj.weight), get(ex.up_proj.weight), get(ex.down_proj.weight).t()])
        elif hasattr(mlp, "router"):  # AutoEPMoELayer: w1 gate, w3 up [E/ep, F, H], w2 down [E/ep, H, F]
            out[pre + "gate.weight"] = get(mlp.router.gate.weight)
            w1, w2, w3 = get(mlp.experts.w1), get(mlp.experts.w2), get(mlp.experts.w3)
            for j in range(w1.shape[0]):
                out[(i, "expert", ep_rank * w1.shape[0] + j)] = torch.cat([w1[j], w3[j], w2[j].t()])
        else:  # reference MoE: gate_up_proj [E, 2F, H] (gate first), down_proj [E, H, F]
            out[pre + "gate.weight"] = get(mlp.gate.weight)
            gu, dn = get(mlp.experts.gate_up_proj), get(mlp.experts.down_proj)
            for e in range(gu.shape[0]):
                out[(i, "expert", e)] = torch.cat([gu[e], dn[e].t()])
    for name, p in model.named_parameters():
        if not any(name.startswith(pre) for pre in moe_prefixes):
            out[name] = get(p)
    return {k: v.detach().float().clone() for k, v in out.items()}


def full_grad(p: torch.Tensor) -> torch.Tensor:
    """The full averaged gradient of ``p`` at any ZeRO stage (collective at ZeRO-1/2/3)."""
    from deepspeed.utils import safe_get_full_grad

    g = safe_get_full_grad(p)
    return torch.zeros_like(p) if g is None else g


def merge(per_rank: list[dict]) -> dict:
    """Union of the ranks' canonical dicts: replicated keys from rank 0, each expert from its owner."""
    out = dict(per_rank[0])
    for d in per_rank[1:]:
        out.update({k: v for k, v in d.items() if k not in out})
    return out


def reference_step(clip: float = CLIP, lr: float = LR) -> dict:
    """Single process, reference backend: ``before``/``grads``/``after`` (canonical dicts), the
    global norm before clipping and the clip coefficient, for one SGD step on both shards."""
    cfg = make_cfg()
    model = build(cfg)
    before = canonical(model, lambda p: p.data)
    for r in range(WORLD):
        ids = shard(r)
        (total_loss(model(ids[:, :-1], labels=ids[:, 1:]), cfg.train) / WORLD).backward()
    grads = canonical(model, lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
    coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    return {"before": before, "grads": grads, "norm": norm, "coef": coef,
            "after": {k: v - lr * coef * grads[k] for k, v in before.items()}}


def ep_rank_of(cfg) -> int:
    from deepspeed.utils import groups

    return groups._get_expert_parallel_rank(f"ep_size_{cfg.moe_runtime.ep_size}") if cfg.moe_runtime.backend != "reference" else 0


def _cases_worker(rank: int, world: int, cases, expert_grad_scale: float = 1.0) -> dict:
    """Every ``(backend, stage)`` of ``cases``, one engine each, in this process.

    ``expert_grad_scale`` != 1 multiplies every expert parameter's gradient (a tensor hook, before
    DeepSpeed sees it): the mutant the comparison must catch (an EP-size scaling bug)."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    from smelt_ds.parallel import moe_backends as mb
    from smelt_ds.parallel.engine import build_ds_config
    from smelt_ds.train.loop import _grad_norm, _grad_norm_before_step

    res = {}
    for backend, stage in cases:
        cfg = make_cfg(backend, stage)
        model = build(cfg)
        if backend != "reference":
            model = mb.apply_backend(model, cfg, zero_stage=stage)
        ds_config = {**build_ds_config(cfg, world), "zero_allow_untested_optimizer": True}
        groups_ = mb.optimizer_param_groups(model, [{"params": list(model.parameters()), "name": "all"}], cfg)
        engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=groups_,
                                          optimizer=mb.moe_optimizer(torch.optim.SGD, lr=LR))
        ep_rank = ep_rank_of(cfg)
        if expert_grad_scale != 1.0:
            from deepspeed.moe.utils import is_moe_param

            for p in model.parameters():
                if is_moe_param(p):
                    p.register_hook(lambda g: g * expert_grad_scale)
        ids = shard(rank)
        out = engine(ids[:, :-1], labels=ids[:, 1:])
        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            before = canonical(model, lambda p: p.data, ep_rank)
        engine.backward(total_loss(out, cfg.train))
        grads = canonical(model, full_grad, ep_rank)  # before clipping
        norm = _grad_norm_before_step(engine, cfg)
        engine.step()
        logged = _grad_norm(engine, norm)
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            after = canonical(model, lambda p: p.data, ep_rank)
        ds_norm = engine.get_global_grad_norm()
        ep_ranks = (dist.get_process_group_ranks(groups._get_expert_parallel_group(f"ep_size_{EP}"))
                    if backend != "reference" else None)
        res[(backend, stage)] = {
            "before": before, "after": after, "grads": grads, "norm": norm, "logged": logged,
            "ds_norm": None if ds_norm is None else float(ds_norm), "ds_clip": engine.gradient_clipping(),
            "config_clip": ds_config["gradient_clipping"], "ep_ranks": ep_ranks,
            "n_experts_local": sum(isinstance(k, tuple) for k in grads)}
    return res


@pytest.fixture(scope="module")
def reference():
    return reference_step()


@pytest.fixture(scope="module")
def distributed_results():
    return run_distributed(_cases_worker, world_size=WORLD, timeout=TIMEOUT_S, args=(CASES,))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_case(ref: dict, per_rank: list[dict], backend: str, stage: int) -> None:
    """All assertions of one distributed case against the reference (raises AssertionError)."""
    label = f"{backend} ZeRO-{stage}"
    for r, res in enumerate(per_rank):
        assert res["norm"] == pytest.approx(ref["norm"], rel=NORM_RTOL), f"{label} rank {r}: norm before step"
        assert res["logged"] == pytest.approx(ref["norm"], rel=NORM_RTOL), f"{label} rank {r}: logged norm"
        if stage > 0:  # DeepSpeed clips with its own norm at ZeRO-1/2/3: it must be the true one
            assert res["ds_norm"] == pytest.approx(ref["norm"], rel=NORM_RTOL), f"{label} rank {r}: DeepSpeed's norm"
        ep_zero0 = backend != "reference" and stage == 0  # smelt clips; DeepSpeed's clipping must be off
        assert res["config_clip"] == res["ds_clip"] == (0.0 if ep_zero0 else CLIP), label
        if backend != "reference":
            assert res["ep_ranks"] == [0, 1], f"{label}: expert-parallel group"
            assert res["n_experts_local"] == 4 * 4 // EP, label  # 4 layers x E/ep experts
    got = {k: merge([res[k] for res in per_rank]) for k in ("before", "grads", "after")}
    assert set(got["after"]) == set(ref["after"]), f"{label}: {set(got['after']) ^ set(ref['after'])}"
    for key in ref["before"]:
        assert torch.equal(got["before"][key], ref["before"][key]), f"{label}: initial weights differ at {key}"
    for key, want in ref["grads"].items():
        torch.testing.assert_close(got["grads"][key], want, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   msg=lambda m: f"{label}: gradient {key}: {m}")
    upd = {k: got["after"][k] - got["before"][k] for k in ref["after"]}
    ref_upd = {k: ref["after"][k] - ref["before"][k] for k in ref["after"]}
    for key in ref_upd:
        assert _rel(upd[key], ref_upd[key]) < UPDATE_RTOL, f"{label}: SGD update of {key}"
    total = _rel(torch.cat([u.flatten() for u in upd.values()]), torch.cat([u.flatten() for u in ref_upd.values()]))
    assert total < UPDATE_RTOL, f"{label}: whole update off by {total:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("backend,stage", CASES)
def test_ep2_matches_single_process_with_clipping(distributed_results, reference, backend, stage):
    """EP=2 (and DP=2 for the reference backend) vs one process: the same norm before clipping
    (computed, logged, and DeepSpeed's where it clips), the same gradients (every router and
    expert), the same clipped SGD step."""
    assert reference["coef"] < 0.1  # clipping is active
    check_case(reference, [r[(backend, stage)] for r in distributed_results], backend, stage)


# ---------------------------------------------------------------------------------------------
# single process: the pieces
# ---------------------------------------------------------------------------------------------


def test_global_grad_norm_divides_by_copies_single_process():
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.bfloat16)
    assert gn.global_grad_norm([gn.GradShard(a), gn.GradShard(b, copies=1)]) == pytest.approx(math.sqrt(50.0))
    assert gn.global_grad_norm([gn.GradShard(a, copies=5)]) == pytest.approx(math.sqrt(5.0))
    assert gn.global_grad_norm([]) == 0.0
    assert math.isnan(gn.global_grad_norm([gn.GradShard(torch.tensor([1.0, float("nan")]))]))
    with pytest.raises(ValueError, match="copies must be >= 1"):
        gn.global_grad_norm([gn.GradShard(a, copies=0)])


def test_clip_grads_matches_torch():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn_like(p)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for t, p in zip(twins, ps):
        t.grad = p.grad.clone()
    total = float(torch.nn.utils.clip_grad_norm_(twins, 0.5))  # torch's reference, returns the norm
    coef = gn.clip_grads_(ps + ps[:1], 0.5, total)  # a parameter listed twice is scaled once
    assert coef == pytest.approx(0.5 / (total + 1e-6), rel=1e-12)
    for p, t in zip(ps, twins):
        torch.testing.assert_close(p.grad, t.grad, rtol=1e-6, atol=0)
    assert gn.clip_grads_(ps, 1e9, total) == 1.0 and gn.clip_grads_(ps, 0.0, total) == 1.0
    assert gn.clip_grads_(ps, 0.5, float("inf")) == 1.0


def test_param_grad_shards_single_process():
    w, e, frozen = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    w.grad, e.grad = torch.full((2,), 3.0), torch.full((2,), 4.0)
    e.allreduce, e.group_name = False, "ep_size_1"
    shards = gn.param_grad_shards([w, e, frozen, w])
    assert [(s.grad is g, s.copies) for s, g in zip(shards, (w.grad, e.grad))] == [(True, 1), (True, 1)]
    assert len(shards) == 2
    assert gn.global_grad_norm(shards) == pytest.approx(math.sqrt(9 * 2 + 16 * 2))


def test_deepspeed_gradient_clipping_per_backend_and_stage():
    for backend in ("reference", "deepspeed", "autoep"):
        for stage in (0, 1, 2, 3):
            if backend == "deepspeed" and stage == 3:
                continue
            want = 0.0 if backend != "reference" and stage == 0 else CLIP
            assert gn.deepspeed_gradient_clipping(make_cfg(backend, stage)) == want, (backend, stage)
    from smelt_ds.parallel.engine import build_ds_config

    assert build_ds_config(make_cfg("autoep", 0), 2)["gradient_clipping"] == 0.0
    assert build_ds_config(make_cfg("autoep", 2), 2)["gradient_clipping"] == CLIP
    # the stage passed through in deepspeed.config wins
    passthrough = make_cfg("deepspeed", 2, config={"zero_optimization": {"stage": 0}})
    assert gn.deepspeed_gradient_clipping(passthrough) == 0.0
    with pytest.raises(ConfigError, match=r"`deepspeed.config.gradient_clipping` \(0.5\).*'autoep'.*train.grad_clip"):
        gn.deepspeed_gradient_clipping(make_cfg("autoep", 0, config={"gradient_clipping": 0.5}))
    assert gn.deepspeed_gradient_clipping(make_cfg("reference", 0, config={"gradient_clipping": 0.5})) == CLIP


class _FakeEngine:
    """The four engine methods :mod:`smelt_ds.parallel.grad_norm` uses, for single-process checks."""

    def __init__(self, module, stage=0, clip=0.0, ds_norm=None, optimizer=None):
        self.module, self.stage, self.clip, self.ds_norm, self.optimizer = module, stage, clip, ds_norm, optimizer

    def zero_optimization_stage(self):
        return self.stage

    def gradient_clipping(self):
        return self.clip

    def get_global_grad_norm(self):
        return self.ds_norm


def _module_with_grads(expert: bool):
    m = torch.nn.Linear(2, 2, bias=False)
    m.weight.grad = torch.full((2, 2), 2.0)  # norm 4
    if expert:
        m.weight.allreduce, m.weight.group_name = False, "ep_size_1"
    return m


def test_clip_before_step_zero0_clips_only_when_deepspeed_does_not():
    m = _module_with_grads(expert=True)
    assert gn.clip_before_step(_FakeEngine(m, clip=0.0), 1.0) == pytest.approx(4.0)
    torch.testing.assert_close(m.weight.grad, torch.full((2, 2), 2.0 / (4.0 + 1e-6)))
    with pytest.raises(ConfigError, match=r"`gradient_clipping` \(1.0\) at ZeRO stage 0 with expert parameters"):
        gn.clip_before_step(_FakeEngine(_module_with_grads(expert=True), clip=1.0), 1.0)
    dense = _module_with_grads(expert=False)  # DeepSpeed clips (correctly): measure only
    assert gn.clip_before_step(_FakeEngine(dense, clip=1.0), 1.0) == pytest.approx(4.0)
    assert torch.equal(dense.weight.grad, torch.full((2, 2), 2.0))


def test_logged_grad_norm_prefers_ours_and_checks_deepspeed():
    m = torch.nn.Linear(1, 1)
    assert gn.logged_grad_norm(_FakeEngine(m, stage=2, ds_norm=torch.tensor(2.0)), 2.0000001) == 2.0000001
    assert gn.logged_grad_norm(_FakeEngine(m, stage=3, ds_norm=torch.tensor(2.5)), None) == 2.5
    assert math.isnan(gn.logged_grad_norm(_FakeEngine(m, stage=0), None))
    assert gn.logged_grad_norm(_FakeEngine(m, stage=0, ds_norm=1.0), 2.0) == 2.0  # ZeRO-0: DeepSpeed's is wrong
    with pytest.raises(RuntimeError, match=r"DeepSpeed clipped with gradient norm 1\.9 at ZeRO stage 2.*true global "
                                           r"norm is 2"):
        gn.logged_grad_norm(_FakeEngine(m, stage=2, ds_norm=1.9), 2.0)
