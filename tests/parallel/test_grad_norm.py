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
:func:`smelt_ds.parallel.ds_config.gradient_clipping`), runs one forward/backward, then
``smelt_ds.train.loop._grad_norm_before_step`` (norm; clipping at ZeRO-0 with an EP backend),
``engine.step()`` and ``smelt_ds.train.loop._grad_norm`` (the logged value).

Tolerances, from fp32 arithmetic (unit roundoff u = 2^-24 = 6.0e-8), never from one machine's
run: the reference and the distributed run compute the same sums in other orders (other kernels,
thread counts, micro-batch accumulation vs all-reduce), so each differs from exact arithmetic by
its own rounding errors and the two differ by at most twice that.

* Gradients, element-wise against the reference: ``|g - g_ref| <= GRAD_TOL * max|g_ref|`` per
  tensor. A first-order error bound of a chain of reductions of lengths ``k_i`` is
  ``sum k_i * u`` times the element's magnitude (its sum of |terms|, taken as the tensor's max;
  ``tests/numerics.py``). ``lm_chain_length`` there adds up the reductions on the longest path
  from a weight through the forward pass (6 visits: norms, projections, attention, router,
  experts; the head and the log-softmax over the vocabulary), back, and over the micro-batch's
  tokens x 2 visits x 2 ranks: 3520, so ``GRAD_TOL = 2 * 3520 * u = 4.2e-4``. It also covers the probabilistic bound
  ``lambda * sqrt(n) * u`` (Higham & Mary 2019, below) with lambda = 10 for elements whose sum of
  |terms| is up to 6x the tensor's max (cancellation). The absolute term scales with the tensor:
  an element near zero (an embedding row hit by one token) gets the tensor's error, not its own
  relative one (a fixed 1e-8 was one ulp of the embedding's largest gradient). Still caught: any
  gradient tensor scaled by 1.0005 (at its largest element), the EP-size bug (experts' gradient
  x 2) by a factor 2400.
* Norms (computed, logged, DeepSpeed's), relative to the fp64 norm of this run's own gradient
  (the same fp32 elements, merged over ranks): one fp32 sum of at most ``P`` = 41760 squares in
  any order. Higham & Mary (SIAM J. Sci. Comput. 41(5), 2019, Thm 3.1): a computed sum of ``n``
  terms is within ``lambda * sqrt(n) * u * sum|terms|`` with probability >= 1 - 2n exp(-lambda^2/2)
  (independent rounding errors, n u << 1); for a sum of squares sum|terms| is the sum itself, and
  the square root halves the relative error: ``NORM_RTOL = 10 * sqrt(P + 1) * u / 2 + 4u = 6.1e-5``
  (failure probability < 1e-16 per norm; the deterministic bound ``P * u / 2 = 1.2e-3`` would
  not catch the bugs below). Still caught: expert gradients counted twice (experts hold 0.1% of
  the squared norm: +5e-4), DeepSpeed's ZeRO-0 norm (2.9e-4 off here).
* The clipped SGD step, element-wise against this run's own gradient ``g`` and the coefficient
  ``c = min(1, CLIP / (||g|| + 1e-6))`` of the norm above: ``|(w' - w) + LR c g| <= (NORM_RTOL +
  8u) LR c |g| + 2u |w'|``: ``c`` from a norm within NORM_RTOL, at most 8 roundings in scaling the
  coefficient and the gradient (DeepSpeed: clip ratio, 1/scale, mul; SGD: lr x grad), and the
  rounding of ``w'`` itself (an absolute ``u |w'|``, which for the RMSNorm weights of 1.0 is a
  large share of their tiny update). Still caught: DeepSpeed's own ZeRO-0 clipping (the update
  2.9e-4 too large, 4.7x the tolerance), a step with the wrong learning rate or coefficient.

The mutants run in the same two processes (:data:`MUTANT_CASES`); :func:`test_mutants_fail`
checks that the gradient comparison catches the EP-size bug and the step check DeepSpeed's own
ZeRO-0 clipping.
"""

from __future__ import annotations

import math

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from smelt_ds.config.loading import config_from_dict  # noqa: E402
from smelt_ds.errors import ConfigError  # noqa: E402
from smelt_ds.model import SmeltLM  # noqa: E402
from smelt_ds.parallel import grad_norm as gn  # noqa: E402
from smelt_ds.testing import run_distributed  # noqa: E402
from smelt_ds.train.objective import total_loss  # noqa: E402
from tests.numerics import FP32_U, chain_tol, lm_chain_length  # noqa: E402

VOCAB, SEQ, MICRO, WORLD, EP = 64, 16, 2, 2, 2
CLIP = 0.05  # the reference norm is 1.445: the step is clipped by 0.0346
LR = 10.0  # SGD; update norm LR * CLIP = 0.5 over 41760 weights
TIMEOUT_S = 420
U = FP32_U
NUM_PARAMS = 41760  # elements of the model (reference layout); checked in check_norms


NORM_RTOL = 10 * math.sqrt(NUM_PARAMS + 1) * U / 2 + 4 * U  # 6.1e-5
STEP_RTOL = NORM_RTOL + 8 * U

#: (backend, ZeRO stage) of the distributed cases; run in this order in one pair of processes
#: (the reference backend last, so that it runs after expert groups exist: a control for leaks).
CASES = ([("deepspeed", s) for s in (0, 1, 2)] + [("autoep", s) for s in (0, 1, 2, 3)]
         + [("reference", s) for s in (0, 1, 2, 3)])
#: (backend, ZeRO stage, mutant), run after CASES in the same processes; see :func:`_cases_worker`.
MUTANT_CASES = [("deepspeed", 0, "expert_grads_x_ep"), ("autoep", 0, "deepspeed_clips_zero0")]


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


#: 4.2e-4 of the tensor's largest gradient: n = 3520 (the module doc)
GRAD_TOL = chain_tol(lm_chain_length(make_cfg(), tokens=MICRO * SEQ * 2 * WORLD))


def shard(rank: int, world: int = WORLD) -> torch.Tensor:
    """Rank ``rank``'s ``(MICRO, SEQ + 1)`` slice of the global batch of ``world`` ranks (same on every call)."""
    g = torch.Generator().manual_seed(123)
    return torch.randint(0, VOCAB, (MICRO * world, SEQ + 1), generator=g)[MICRO * rank: MICRO * (rank + 1)]


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


def merged(per_rank: list[dict]) -> dict:
    """``before``/``grads``/``after`` of one case, each merged over the ranks (:func:`merge`)."""
    return {k: merge([res[k] for res in per_rank]) for k in ("before", "grads", "after")}


def reference_step(clip: float = CLIP, lr: float = LR, world: int = WORLD) -> dict:
    """Single process, reference backend: ``before``/``grads``/``after`` (canonical dicts), the
    global norm before clipping and the clip coefficient, for one SGD step on the shards of all
    ``world`` ranks."""
    cfg = make_cfg()
    model = build(cfg)
    before = canonical(model, lambda p: p.data)
    for r in range(world):
        ids = shard(r, world)
        (total_loss(model(ids[:, :-1], labels=ids[:, 1:]), cfg.train) / world).backward()
    grads = canonical(model, lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
    coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    return {"before": before, "grads": grads, "norm": norm, "coef": coef,
            "after": {k: v - lr * coef * grads[k] for k, v in before.items()}}


def ep_rank_of(cfg) -> int:
    from deepspeed.utils import groups

    if cfg.moe_runtime.backend == "reference":
        return 0
    return groups._get_expert_parallel_rank(f"ep_size_{cfg.moe_runtime.ep_size}")


def _cases_worker(rank: int, world: int, cases) -> dict:
    """Every ``(backend, stage)`` or ``(backend, stage, mutant)`` of ``cases``, one engine each, in
    this process; results keyed by the case tuple.

    Mutants: ``"expert_grads_x_ep"`` multiplies every expert parameter's gradient by ``EP`` (a
    tensor hook, before DeepSpeed sees it; an EP-size scaling bug); ``"deepspeed_clips_zero0"``
    turns DeepSpeed's own ZeRO-0 clipping on (``gradient_clipping`` = CLIP) and only measures the
    norm instead of smelt's clip-before-step."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    from smelt_ds.parallel import moe_backends as mb
    from smelt_ds.parallel.ds_config import build_ds_config
    from smelt_ds.train.loop import _grad_norm, _grad_norm_before_step

    res = {}
    for case in cases:
        backend, stage, mutant = (*case, None)[:3]
        cfg = make_cfg(backend, stage)
        model = build(cfg)
        if backend != "reference":
            model = mb.apply_backend(model, cfg, zero_stage=stage)
        ds_config = {**build_ds_config(cfg, world), "zero_allow_untested_optimizer": True}
        if mutant == "deepspeed_clips_zero0":
            ds_config["gradient_clipping"] = CLIP
        groups_ = mb.optimizer_param_groups(model, [{"params": list(model.parameters()), "name": "all"}], cfg)
        engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=groups_,
                                          optimizer=mb.moe_optimizer(torch.optim.SGD, lr=LR))
        ep_rank = ep_rank_of(cfg)
        if mutant == "expert_grads_x_ep":
            from deepspeed.moe.utils import is_moe_param

            for p in model.parameters():
                if is_moe_param(p):
                    p.register_hook(lambda g: g * EP)
        ids = shard(rank, world)
        out = engine(ids[:, :-1], labels=ids[:, 1:])
        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            before = canonical(model, lambda p: p.data, ep_rank)
        engine.backward(total_loss(out, cfg.train))
        grads = canonical(model, full_grad, ep_rank)  # before clipping
        norm = gn.engine_grad_norm(engine) if mutant == "deepspeed_clips_zero0" else _grad_norm_before_step(engine, cfg)
        engine.step()
        logged = _grad_norm(engine, norm)
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            after = canonical(model, lambda p: p.data, ep_rank)
        ds_norm = engine.get_global_grad_norm()
        ep_ranks, edp_ranks = ((dist.get_process_group_ranks(groups._get_expert_parallel_group(f"ep_size_{EP}")),
                                dist.get_process_group_ranks(groups._get_expert_data_parallel_group(f"ep_size_{EP}")))
                               if backend != "reference" else (None, None))
        res[case] = {
            "before": before, "after": after, "grads": grads, "norm": norm, "logged": logged,
            "ds_norm": None if ds_norm is None else float(ds_norm), "ds_clip": engine.gradient_clipping(),
            "config_clip": ds_config["gradient_clipping"], "ep_ranks": ep_ranks, "edp_ranks": edp_ranks,
            "n_experts_local": sum(isinstance(k, tuple) for k in grads)}
    return res


@pytest.fixture(scope="module")
def reference():
    return reference_step()


@pytest.fixture(scope="module")
def distributed_results():
    return run_distributed(_cases_worker, world_size=WORLD, timeout=TIMEOUT_S, args=(CASES + MUTANT_CASES,))


def check_case(ref: dict, per_rank: list[dict], backend: str, stage: int, grad_tol: float = GRAD_TOL) -> None:
    """All assertions of one distributed case against the reference (raises AssertionError).

    With an EP backend, ranks ``[k EP, (k + 1) EP)`` form expert-parallel group k and together hold
    one whole model (its experts replicated on the ``world / EP`` ranks of an expert-data-parallel
    group, ``r, r + EP, ...``); each group's model is checked."""
    label = f"{backend} ZeRO-{stage}"
    world = len(per_rank)
    for r, res in enumerate(per_rank):
        ep_zero0 = backend != "reference" and stage == 0  # smelt clips; DeepSpeed's clipping must be off
        assert res["config_clip"] == res["ds_clip"] == (0.0 if ep_zero0 else CLIP), label
        if backend != "reference":
            first = r - r % EP
            assert res["ep_ranks"] == list(range(first, first + EP)), f"{label} rank {r}: expert-parallel group"
            assert res["edp_ranks"] == list(range(r % EP, world, EP)), f"{label} rank {r}: expert-data-parallel group"
            assert res["n_experts_local"] == 4 * 4 // EP, label  # 4 layers x E/ep experts
    models = [per_rank[k: k + EP] for k in range(0, world, EP)] if backend != "reference" else [per_rank]
    for k, ranks in enumerate(models):
        got = merged(ranks)
        where = label if len(models) == 1 else f"{label}, expert-parallel group {k}"
        assert set(got["after"]) == set(ref["after"]), f"{where}: {set(got['after']) ^ set(ref['after'])}"
        for key in ref["before"]:
            assert torch.equal(got["before"][key], ref["before"][key]), f"{where}: initial weights differ at {key}"
        check_grads(ref, got, where, grad_tol)
        check_norms(per_rank, got, stage, where)
        check_step(got, where)


def check_grads(ref: dict, got: dict, label: str, tol: float = GRAD_TOL) -> None:
    """Every gradient element within ``tol`` of its tensor's largest reference gradient."""
    for key, want in ref["grads"].items():
        torch.testing.assert_close(got["grads"][key], want, rtol=0.0, atol=tol * float(want.abs().max()),
                                   msg=lambda m, key=key: f"{label}: gradient {key}: {m}")


def own_norm(got: dict) -> float:
    """The fp64 L2 norm of a run's merged gradients (every element once)."""
    return math.sqrt(sum(float(g.double().square().sum()) for g in got["grads"].values()))


def check_norms(per_rank: list[dict], got: dict, stage: int, label: str) -> None:
    """The computed, logged and (ZeRO-1/2/3) DeepSpeed norms equal the norm of the run's gradients."""
    assert sum(g.numel() for g in got["grads"].values()) == NUM_PARAMS, label
    want = own_norm(got)
    for r, res in enumerate(per_rank):
        names = ("norm", "logged") + (("ds_norm",) if stage > 0 else ())  # DeepSpeed clips with its own at 1/2/3
        for name in names:
            assert res[name] == pytest.approx(want, rel=NORM_RTOL), f"{label} rank {r}: {name}"


def check_step(got: dict, label: str) -> None:
    """The SGD step is ``-LR * c * g`` with the clip coefficient ``c`` of the run's own norm."""
    coef = min(1.0, CLIP / (own_norm(got) + 1e-6))
    for key, g in got["grads"].items():
        g, before, after = g.double(), got["before"][key].double(), got["after"][key].double()
        err = (after - before + LR * coef * g).abs()
        tol = STEP_RTOL * LR * coef * g.abs() + 2 * U * after.abs()
        worst = float((err / tol.clamp_min(1e-300)).max())
        assert worst <= 1.0, f"{label}: SGD step of {key} off by {worst:.3g}x its tolerance"


@pytest.mark.distributed
@pytest.mark.parametrize("backend,stage", CASES)
def test_ep2_matches_single_process_with_clipping(distributed_results, reference, backend, stage):
    """EP=2 (and DP=2 for the reference backend) vs one process: the same gradients (every router
    and expert); the norm before clipping (computed, logged, and DeepSpeed's where it clips) is
    theirs; the step is SGD clipped by that norm."""
    assert reference["coef"] < 0.1  # clipping is active
    check_case(reference, [r[(backend, stage)] for r in distributed_results], backend, stage)


@pytest.mark.distributed
def test_mutants_fail(distributed_results, reference):
    """The checks catch the bugs they guard (MUTANT_CASES, run in the same processes): expert
    gradients scaled by the EP size fail the gradient comparison, DeepSpeed's own ZeRO-0 clipping
    (its norm 2.9e-4 off) fails the step check though its gradients and smelt's norm are right."""
    scaled = [r[MUTANT_CASES[0]] for r in distributed_results]
    got = merged(scaled)
    with pytest.raises(AssertionError, match=r"gradient \(\d+, 'expert'"):
        check_grads(reference, got, "expert gradients x EP")
    ds_clips = [r[MUTANT_CASES[1]] for r in distributed_results]
    got = merged(ds_clips)
    check_grads(reference, got, "DeepSpeed clips at ZeRO-0")
    check_norms(ds_clips, got, 0, "DeepSpeed clips at ZeRO-0")
    with pytest.raises(AssertionError, match="SGD step"):
        check_step(got, "DeepSpeed clips at ZeRO-0")


#: World 4 with EP 2: every expert lives on 2 ranks (expert-data-parallel groups [0, 2] and [1, 3]);
#: the cases run in one set of 4 processes
WORLD_EDP = 4
EDP_CASES = [("deepspeed", 0), ("autoep", 0), ("autoep", 2)]
#: the gradient chain of GRAD_TOL over the 4 ranks' tokens: 4.3e-4
EDP_GRAD_TOL = chain_tol(lm_chain_length(make_cfg(), tokens=MICRO * SEQ * 2 * WORLD_EDP))


@pytest.mark.distributed
def test_expert_data_parallel_2_matches_single_process_with_clipping():
    """4 ranks, EP 2, so each expert's gradient is on the 2 ranks of its expert-data-parallel group
    (at ZeRO-0 a whole copy on each, at ZeRO-2 a partition each): against one process on all 4 shards,
    each expert-parallel group's model has the same gradients (``EDP_GRAD_TOL``), the computed, logged
    and (ZeRO-2) DeepSpeed norms equal the norm of those gradients counting every element once
    (``NORM_RTOL``; counting the replicated expert gradients twice adds the experts' share of the
    squared norm, about 5e-4), and the step is SGD clipped by that norm (``STEP_RTOL``)."""
    per_rank = run_distributed(_cases_worker, world_size=WORLD_EDP, timeout=TIMEOUT_S, args=(EDP_CASES,))
    ref = reference_step(world=WORLD_EDP)
    assert ref["coef"] < 0.1  # clipping is active
    for backend, stage in EDP_CASES:
        check_case(ref, [r[(backend, stage)] for r in per_rank], backend, stage, EDP_GRAD_TOL)


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
    for t, p in zip(twins, ps, strict=True):
        t.grad = p.grad.clone()
    total = float(torch.nn.utils.clip_grad_norm_(twins, 0.5))  # torch's reference, returns the norm
    coef = gn.clip_grads_(ps + ps[:1], 0.5, total)  # a parameter listed twice is scaled once
    assert coef == pytest.approx(0.5 / (total + 1e-6), rel=1e-12)
    for p, t in zip(ps, twins, strict=True):  # torch's fp32 coefficient (2 roundings) vs ours (1), each product 1: 5u
        torch.testing.assert_close(p.grad, t.grad, rtol=1e-6, atol=0)
    assert gn.clip_grads_(ps, 1e9, total) == 1.0 and gn.clip_grads_(ps, 0.0, total) == 1.0
    assert gn.clip_grads_(ps, 0.5, float("inf")) == 1.0


def test_param_grad_shards_single_process():
    w, e, frozen = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    w.grad, e.grad = torch.full((2,), 3.0), torch.full((2,), 4.0)
    e.allreduce, e.group_name = False, "ep_size_1"
    shards = gn.param_grad_shards([w, e, frozen, w])
    assert [(s.grad is g, s.copies) for s, g in zip(shards, (w.grad, e.grad), strict=True)] == [(True, 1), (True, 1)]
    assert len(shards) == 2
    assert gn.global_grad_norm(shards) == pytest.approx(math.sqrt(9 * 2 + 16 * 2))


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
