"""The training step (``smelt_ds.train.loop._train_step``) on 2 gloo ranks, against references computed
in one process or by hand.

Each worker builds the engine as training does (:func:`smelt_ds.train.build.build`: AdamW, the LR
schedule, the MoE backend, the DeepSpeed config) and runs one real ``_train_step`` on a fit whose
data feed hands out the test's own micro-batches (``shard``: a different slice of one global batch
per rank and micro-step), so the reference sees exactly the batches each rank trained on. The tiny
model is ``tests/parallel/test_grad_norm.py``'s (hidden 32, 4 unique layers with the middle two
looped, 4 experts, top-2, micro-batch 2 of 16 tokens).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from smelt_ds.config.loading import config_from_dict  # noqa: E402
from smelt_ds.testing import run_distributed  # noqa: E402
from smelt_ds.train.step_guard import StepGuardState  # noqa: E402
from tests.numerics import FP32_U, chain_tol, lm_chain_length  # noqa: E402
from tests.parallel.test_grad_norm import NORM_RTOL, canonical, make_cfg, merge  # noqa: E402

VOCAB, SEQ, MICRO, WORLD = 64, 16, 2, 2
U = FP32_U


def _cfg(backend: str, stage: int = 0, moe: dict | None = None, train: dict | None = None):
    """``make_cfg(backend, stage)`` of the grad-norm tests with ``moe`` / ``train`` fields replaced."""
    raw = make_cfg(backend, stage).model_dump(mode="json")
    raw["moe"].update(moe or {})
    raw["train"].update(train or {})
    return config_from_dict(raw)


def shard(rank: int, micro: int, world: int = WORLD, accum: int = 1) -> torch.Tensor:
    """Rank ``rank``'s micro-batch ``micro`` ``(MICRO, SEQ + 1)``: rows of one seeded global batch of
    ``MICRO * world * accum`` windows."""
    g = torch.Generator().manual_seed(321)
    rows = torch.randint(0, VOCAB, (MICRO * world * accum, SEQ + 1), generator=g)
    first = MICRO * (micro * world + rank)
    return rows[first: first + MICRO]


def _one_step(cfg, rank: int, world: int, on_built=None) -> tuple[object, SimpleNamespace]:
    """Build as training does and run one ``_train_step`` on this rank's micro-batches; ``on_built(built)``
    runs between the two. Returns ``(built, fit)``."""
    from smelt_ds.train.build import build
    from smelt_ds.train.data import Batch
    from smelt_ds.train.loop import _train_step
    from smelt_ds.train.metrics import MicroStats

    built = build(cfg, world)
    if on_built is not None:
        on_built(built)
    accum = built.engine.gradient_accumulation_steps()
    batches = iter([shard(rank, m, world, accum) for m in range(accum)])

    def next_batch() -> Batch:
        ids = next(batches)
        return Batch(ids[:, :-1], ids[:, 1:], torch.arange(MICRO))

    fit = SimpleNamespace(built=built, cfg=cfg, accum=accum, data=SimpleNamespace(train=SimpleNamespace(
        next_batch=next_batch)), micro=MicroStats(), step=0, tokens_seen=0,
        tokens_per_step=MICRO * SEQ * accum * world, guard=StepGuardState(cfg.train.step_guard), skipped_since_log=0,
        writer=SimpleNamespace(write=lambda *a, **k: None), console=SimpleNamespace(line=lambda *a, **k: None),
        device=built.engine.device, stops=None, stop_reason=None)
    fit.result = _train_step(fit)  # (lr, sample ids, grad norm before clipping, means)
    return built, fit


# ---------------------------------------------------------------------------------------------
# a. the aux-loss-free bias update: counts summed over the data-parallel ranks
# ---------------------------------------------------------------------------------------------

RATE = 0.25  # moe.bias_update_rate


def _bias_worker(rank: int, world: int) -> dict:
    """One step with ``moe.aux_loss_free_bias``; every expert choice each router made with grad on
    (a forward hook on its output ``topk_idx``), and the biases after the step."""
    from smelt_ds.model.router import TopKRouter

    cfg = _cfg("reference", moe={"aux_loss_free_bias": True, "bias_update_rate": RATE})
    chosen: dict[int, list[torch.Tensor]] = {}

    def hook(i):
        def record(mod, inp, out):
            if torch.is_grad_enabled():
                chosen.setdefault(i, []).append(out[2].detach().reshape(-1).clone())
        return record

    def on_built(built):
        for i, r in enumerate(m for m in built.model.modules() if isinstance(m, TopKRouter)):
            r.register_forward_hook(hook(i))

    built, _ = _one_step(cfg, rank, world, on_built)
    routers = [m for m in built.model.modules() if isinstance(m, TopKRouter)]
    return {"counts": [torch.bincount(torch.cat(chosen[i]), minlength=4) for i in range(len(routers))],
            "bias": [r.expert_bias.clone() for r in routers],
            "pending": [r.tokens_per_expert.clone() for r in routers]}


@pytest.mark.slow
@pytest.mark.distributed
def test_aux_loss_free_bias_uses_the_counts_of_every_rank():
    """2 ranks, different micro-batches, one real training step: the bias of every router on both
    ranks is ``rate * sign(mean(c) - c)`` of the expert counts ``c`` summed over both ranks (DeepSeek-V3
    §2.1.2), counted here by hand from the routers' own choices. Exact: counts are integers (below
    2^24), their mean divides by E = 4 (a power of two), and ``0 + rate * sign`` rounds once both ways."""
    res = run_distributed(_bias_worker, world_size=WORLD, timeout=240)
    visits = [1, 2, 2, 1]  # layers 0..3 of the middle loop: the looped two run twice
    rate = torch.tensor(RATE, dtype=torch.float32)
    local_differs = False
    for layer, v in enumerate(visits):
        counts = [r["counts"][layer] for r in res]
        for c in counts:  # every token of every visit chose top-2 experts
            assert int(c.sum()) == MICRO * SEQ * 2 * v, f"layer {layer}: {c.tolist()}"
        total = (counts[0] + counts[1]).double()
        want = rate * torch.sign(total.mean() - total).float()
        for r, got in enumerate(res):
            assert torch.equal(got["bias"][layer], want), (
                f"layer {layer} rank {r}: bias {got['bias'][layer].tolist()}, want {want.tolist()} from the counts "
                f"summed over ranks {total.tolist()} (this rank's own: {counts[r].tolist()})")
            assert not got["pending"][layer].any(), "the counts are reset after the update"
            local_differs |= not torch.equal(torch.sign(counts[r].double().mean() - counts[r].double()),
                                             torch.sign(total.mean() - total))
    assert local_differs, "no rank's own counts give another update: this data cannot tell a missing all-reduce"


# ---------------------------------------------------------------------------------------------
# b. gradient accumulation with an expert-parallel backend at ZeRO-0 (smelt clips there)
# ---------------------------------------------------------------------------------------------

ACCUM = 2
CLIP = 0.05  # the global norm is about 1 here: clipping is active (asserted)
LR, EPS = 10.0, 1.0
#: AdamW with eps = 1 (no weight decay, constant LR, no warmup): the first step moves a weight by
#: ``lr * x / (|x| + eps)`` for its clipped gradient ``x`` (``|x|`` about 1e-4 here), nearly linear
#: in ``x``, so a wrong clipping coefficient shows (with eps = 1e-8 the step would be ``lr * sign(x)``)
ACCUM_TRAIN = {"gradient_accumulation_steps": ACCUM, "grad_clip": CLIP, "lr": LR, "eps": EPS,
               "weight_decay": 0.0, "warmup_steps": 0, "schedule": "constant", "max_steps": 1}
#: gradients: the chain of ``tests/parallel/test_grad_norm.py`` over twice the tokens (2 micro-steps)
ACCUM_GRAD_TOL = chain_tol(lm_chain_length(_cfg("reference", train=ACCUM_TRAIN),
                                           tokens=MICRO * SEQ * 2 * WORLD * ACCUM))
#: roundings in AdamW's first step after clipping, each relative to the update: c * g (1), m and v
#: (3), the bias corrections and step size (3), sqrt(v) / sqrt(bc2) + eps (3), addcdiv (2); both runs
ADAM_RTOL = 2 * 12 * U


def _accum_worker(rank: int, world: int) -> dict:
    """One step of AutoEP (ep 2) at ZeRO-0 with 2 micro-steps: weights before and after, the gradient
    the step clipped (recorded by wrapping ``_grad_norm_before_step``), the norm it returned."""
    from smelt_ds.train import loop
    from tests.parallel.test_grad_norm import ep_rank_of, full_grad

    cfg = _cfg("autoep", 0, train=ACCUM_TRAIN)
    seen: dict = {}
    real = loop._grad_norm_before_step

    def grad_norm_before_step(engine, c):
        seen["grads"] = canonical(engine.module, full_grad, ep_rank_of(cfg))
        return real(engine, c)

    def on_built(built):
        seen["before"] = canonical(built.model, lambda p: p.data, ep_rank_of(cfg))

    loop._grad_norm_before_step = grad_norm_before_step
    try:
        built, fit = _one_step(cfg, rank, world, on_built)
    finally:
        loop._grad_norm_before_step = real
    assert built.engine.gradient_clipping() == 0.0  # DeepSpeed's ZeRO-0 clipping is off: smelt clips
    return {**seen, "after": canonical(built.model, lambda p: p.data, ep_rank_of(cfg)), "norm": fit.result[2],
            "accum": fit.accum}


def _accum_reference() -> dict:
    """One process, reference backend, the same initial weights: the losses of all 4 micro-batches
    (2 ranks x 2 micro-steps), each divided by 4 (DeepSpeed divides by the accumulation steps, the
    all-reduce averages over ranks), clipped by the global norm, one AdamW step."""
    from smelt_ds.model import SmeltLM
    from smelt_ds.train.objective import total_loss

    cfg = _cfg("reference", train=ACCUM_TRAIN)
    torch.manual_seed(cfg.train.seed)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    before = canonical(model, lambda p: p.data)
    for m in range(ACCUM):
        for r in range(WORLD):
            ids = shard(r, m, WORLD, ACCUM)
            (total_loss(model(ids[:, :-1], labels=ids[:, 1:]), cfg.train) / (WORLD * ACCUM)).backward()
    grads = canonical(model, lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
    norm = float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=cfg.train.betas, eps=EPS, weight_decay=0.0)
    opt.step()
    return {"before": before, "grads": grads, "norm": norm, "after": canonical(model, lambda p: p.data)}


@pytest.mark.slow
@pytest.mark.distributed
def test_gradient_accumulation_with_expert_parallelism_at_zero0_matches_one_process():
    """AutoEP, 2 ranks (ep 2), ZeRO-0, 2 micro-steps per optimizer step, one real training step: the
    accumulated gradient, the norm the step clipped by and the updated weights equal one process
    accumulating the same 4 micro-batches and clipping by their global norm.

    Tolerances (fp32, u = 2^-24): gradients within ``ACCUM_GRAD_TOL`` (``2 n u``, n the reduction chain
    of ``tests/numerics.py`` over the step's tokens) of each tensor's largest reference gradient. The
    norms differ by at most ``||g - g_ref|| <= ACCUM_GRAD_TOL * sqrt(sum_t n_t max|g_ref,t|^2)`` (the
    gradient bound, tensor t with n_t elements) plus each norm's own rounding (``NORM_RTOL`` of
    test_grad_norm, twice). A weight moves by ``lr * x / (|x| + eps)``, whose derivative in x is at most
    ``1 / eps``, so the weights differ by at most ``lr / eps * (c * dg + |g_ref| * dc)`` (``dg`` the
    gradient bound, ``dc = c * dnorm / norm`` from the norm bound) plus ``ADAM_RTOL`` of the update
    and the rounding of both new weights (``2 u |w|``)."""
    res = run_distributed(_accum_worker, world_size=WORLD, timeout=240)
    ref = _accum_reference()
    assert [r["accum"] for r in res] == [ACCUM, ACCUM]
    got = {k: merge([r[k] for r in res]) for k in ("before", "grads", "after")}
    assert set(got["after"]) == set(ref["after"])
    for key, want in ref["before"].items():
        assert torch.equal(got["before"][key], want), f"initial weights differ at {key}"
    for key, want in ref["grads"].items():
        torch.testing.assert_close(got["grads"][key], want, rtol=0.0, atol=ACCUM_GRAD_TOL * float(want.abs().max()),
                                   msg=lambda m, key=key: f"accumulated gradient {key}: {m}")
    spread = math.sqrt(sum(g.numel() * float(g.abs().max()) ** 2 for g in ref["grads"].values()))
    dnorm = ACCUM_GRAD_TOL * spread + 2 * NORM_RTOL * ref["norm"]
    for r in res:
        assert abs(r["norm"] - ref["norm"]) <= dnorm, f"clipped by norm {r['norm']}, one process {ref['norm']}"
    coef = CLIP / (ref["norm"] + 1e-6)
    assert coef < 0.1  # clipping is active
    dcoef = coef * dnorm / ref["norm"]
    for key, want in ref["after"].items():
        g, w = ref["grads"][key].double(), want.double()
        update = (ref["before"][key].double() - w).abs()
        tol = (LR / EPS * (coef * ACCUM_GRAD_TOL * float(g.abs().max()) + g.abs() * dcoef) + ADAM_RTOL * update
               + 2 * U * w.abs())
        worst = float(((got["after"][key].double() - w).abs() / tol).max())
        assert worst <= 1.0, f"updated weight {key} off by {worst:.3g}x its tolerance"
