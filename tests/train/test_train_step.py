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

from types import SimpleNamespace

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from smelt_ds.config.loading import config_from_dict  # noqa: E402
from smelt_ds.testing import run_distributed  # noqa: E402
from tests.parallel.test_grad_norm import make_cfg  # noqa: E402

VOCAB, SEQ, MICRO, WORLD = 64, 16, 2, 2


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
        tokens_per_step=MICRO * SEQ * accum * world)
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
