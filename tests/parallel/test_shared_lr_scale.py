"""``loop.shared_lr_scale`` reaches the optimizer: per-group learning rates and one AdamW update of
looped (shared) and unlooped parameters, under ZeRO 0/2/3 and every MoE backend, on 2 gloo ranks.

Reference (hand-derived, torch's AdamW): at step 1 the bias-corrected moments are ``m = g`` and
``v = g^2``, so an element moves by

    p1 = p0 * (1 - lr_g * wd_g) - lr_g * g / (|g| + eps)

with ``lr_g = train.lr * lr_scale`` of its group (``shared_lr_scale`` for parameters of looped
layers, 1 otherwise; constant schedule, no warmup) and ``wd_g`` its group's weight decay. Where
``|g| >> eps`` the second term is ``lr_g`` in magnitude, so ``|p1 - p0 (1 - lr_g wd_g)| / lr_g``
is 1 for both kinds of parameter exactly when the scale is applied to the right ones; with the
scale missing (or applied to every group) it is 4 (or 0.25) for one kind. ``g`` is the gradient
the optimizer stepped with (DeepSpeed's ``safe_get_full_grad``: averaged over ranks, expert
parameters over their expert-data group), ``p0``/``p1`` the fp32 values (``safe_get_full_fp32_param``
under ZeRO; the parameters themselves at ZeRO-0).

Tiny model: 4 unique layers, middle loop (plan 0 1 2 1 2 3: layers 1 and 2 are looped), hidden
32, 4 experts top-2 of size 16; ``ep_size`` 2 for the expert-parallel backends. All 8 cells run
in one pair of processes, one engine after another (DeepSpeed allows that), so the file spawns once.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from smelt_ds.config.loading import config_from_dict  # noqa: E402
from smelt_ds.testing import run_distributed  # noqa: E402
from smelt_ds.train.objective import total_loss  # noqa: E402
from tests.numerics import FP32_U  # noqa: E402

pytestmark = pytest.mark.distributed

WORLD, SEQ, MICRO = 2, 16, 2
LR, SCALE, WD, EPS = 1e-2, 0.25, 0.1, 1e-8
LOOPED_LAYERS = {1, 2}
CELLS = [("reference", 0), ("reference", 2), ("reference", 3), ("deepspeed", 0), ("deepspeed", 2),
         ("autoep", 0), ("autoep", 2), ("autoep", 3)]
# an element counts as "|g| >> eps" above this gradient magnitude: g / (|g| + eps) is then 1 within 1e-4
BIG_GRAD = 1e-4
# fp32 rounding of the update formula (u = 2^-24): the optimizer's and this test's roundings of
# p0 (1 - lr wd) and of p1 (u |p| each, |p| <= 1.01: RMSNorm weights start at 1.0, the rest at
# N(0, 0.02), one step moves them by <= LR) and at most 8 roundings in lr g / (|g| + eps):
# 3 u 1.01 + 8 u LR = 1.9e-7. A wrong group lr moves an element by 0.75 * LR = 7.5e-3.
UPDATE_ATOL = FP32_U * (3 * 1.01 + 8 * LR)


def _raw(backend: str, stage: int) -> dict:
    moe = {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16}
    runtime: dict = {"backend": backend}
    if backend != "reference":
        runtime["ep_size"] = 2
    if backend == "deepspeed":
        runtime["drop_tokens"] = False
    return {"name": "lr-scale", "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4,
                                          "num_kv_heads": 2, "max_seq_len": 32},
            "moe": moe, "moe_runtime": runtime, "loop": {"position": "middle", "shared_lr_scale": SCALE},
            "train": {"seq_len": SEQ, "micro_batch_size": MICRO, "lr": LR, "warmup_steps": 0,
                      "schedule": "constant", "max_steps": 10, "weight_decay": WD, "eps": EPS,
                      "grad_clip": 0.0},
            "deepspeed": {"zero_stage": stage}}


def _is_looped(name: str) -> bool:
    """By name, independent of ``SmeltLM.looped_parameter_names``: ``layers.{1,2}.*`` (every
    backend keeps the layer prefix; AutoEP renames only inside ``mlp``)."""
    parts = name.split(".")
    return parts[0] == "layers" and int(parts[1]) in LOOPED_LAYERS


def _fp32(p: torch.Tensor) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(p)
    return (p if full is None else full).detach().float().clone()


def _one_step(backend: str, stage: int, rank: int, world: int) -> dict:
    from deepspeed.utils import safe_get_full_grad

    from smelt_ds.train.build import build

    cfg = config_from_dict(_raw(backend, stage))
    built = build(cfg, world)  # model, backend, checkpointing, engine as training builds them
    engine, opt = built.engine, built.engine.optimizer
    ids = torch.randint(0, 64, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(10 + rank))
    out = engine(ids[:, :-1], labels=ids[:, 1:])
    engine.backward(total_loss(out, cfg.train))
    params = dict(engine.module.named_parameters())
    before = {n: _fp32(p) for n, p in params.items()}
    grads = {n: safe_get_full_grad(p).detach().float().clone() for n, p in params.items()}
    engine.step()
    after = {n: _fp32(p) for n, p in params.items()}
    groups = [{"name": g.get("name"), "lr": g["lr"], "lr_scale": g.get("lr_scale"), "moe": bool(g.get("moe")),
               "weight_decay": g["weight_decay"]} for g in opt.param_groups]
    no_decay = {n for n, p in params.items() if p.ndim < 2 or "norm" in n or "embed_tokens" in n}
    return {"before": before, "after": after, "grads": grads, "groups": groups, "no_decay": no_decay}


def _worker(rank: int, world: int) -> dict:
    """Every cell in turn; a cell that raises reports its error instead of hiding the others."""
    import gc
    import traceback

    out = {}
    for backend, stage in CELLS:
        try:
            out[(backend, stage)] = _one_step(backend, stage, rank, world)
        except Exception as e:  # noqa: BLE001 - reported per cell by the tests below
            out[(backend, stage)] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        gc.collect()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, WORLD, timeout=300)


def _cell(results, cell):
    per_rank = [r[cell] for r in results]
    for r in per_rank:
        if isinstance(r, str):
            pytest.fail(f"{cell}: {r}")
    return per_rank


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"{c[0]}-zero{c[1]}")
def test_group_learning_rates(results, cell):
    """The optimizer's groups (after DeepSpeed built it and stepped the LambdaLR once) are
    {decay, no_decay} x {unlooped, looped} with lr ``train.lr`` and ``shared_lr_scale * train.lr``,
    plus, for the expert-parallel backends, the expert parameters split off into ``moe`` groups
    that keep their source group's scale: one unlooped, one looped."""
    for res in _cell(results, cell):
        groups = res["groups"]
        got = sorted((g["name"], g["moe"], g["lr_scale"], g["weight_decay"]) for g in groups)
        want = [("decay", False, 1.0, WD), ("decay_looped", False, SCALE, WD), ("no_decay", False, 1.0, 0.0),
                ("no_decay_looped", False, SCALE, 0.0)]
        if cell[0] != "reference":
            want += [("ep_size_2", True, SCALE, WD), ("ep_size_2", True, 1.0, WD)]
        assert got == sorted(want), groups
        for g in groups:
            assert g["lr"] == pytest.approx(LR * g["lr_scale"], rel=1e-12), g


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"{c[0]}-zero{c[1]}")
def test_first_adamw_update_uses_the_group_lr(results, cell):
    """Elementwise against the AdamW step-1 formula (module docstring), for every parameter; and
    the ratio |update| / lr_group is 1 on the elements with |g| >> eps of looped and unlooped
    parameters alike (4 or 0.25 for one kind if the scale went to the wrong groups)."""
    for res in _cell(results, cell):
        kinds = {True: [], False: []}
        for n, p0 in res["before"].items():
            p1, g = res["after"][n], res["grads"][n]
            lr_g = LR * (SCALE if _is_looped(n) else 1.0)
            wd = 0.0 if n in res["no_decay"] else WD
            want = p0 * (1 - lr_g * wd) - lr_g * g / (g.abs() + EPS)
            torch.testing.assert_close(p1, want, rtol=0, atol=UPDATE_ATOL, msg=f"{cell} {n}")
            big = g.abs() > BIG_GRAD
            kinds[_is_looped(n)].append(((p1 - p0 * (1 - lr_g * wd)).abs() / lr_g)[big])
        for looped, ratios in kinds.items():
            r = torch.cat(ratios)
            assert r.numel() > 100, (cell, looped)
            # |g| > BIG_GRAD: 1 within eps / BIG_GRAD = 1e-4, plus 2 u |p| / (LR SCALE) = 5e-5 of rounding
            assert float((r - 1).abs().max()) < 1e-3, (cell, looped, float(r.min()), float(r.max()))
