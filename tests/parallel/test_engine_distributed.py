"""DeepSpeed engine correctness with real processes (2 gloo ranks) against plain PyTorch.

The reference for a data-parallel step on ranks r=0..R-1 with micro-batches b_r is one process
that computes ``mean_r loss(b_r)`` (each rank's loss on its own micro-batch, as DDP/ZeRO average
gradients), clips the global gradient norm and steps torch's AdamW with the same groups and
LambdaLR schedule. Tolerances (``tests/numerics.py``) are for fp32 with different reduction
orders: gradients element-wise within ``2 n u`` of each tensor's largest, ``n = N_STEP`` the
reduction lengths of one forward and backward pass (4.3e-4); losses of step ``s`` relative within
Higham & Mary's probabilistic bound over ``s`` such passes (1.2e-4 at step 3); learning rates to
1e-6 relative (both schedules are the same formula in Python doubles).
"""

from __future__ import annotations

import gc

import pytest
import torch

from smelt_ds.config.loading import config_from_dict
from smelt_ds.model import SmeltLM
from smelt_ds.parallel.engine import lr_multiplier, param_groups
from smelt_ds.testing import run_distributed
from smelt_ds.train.objective import total_loss
from tests.numerics import assert_close_chain, lm_chain_length, prob_tol

pytestmark = pytest.mark.distributed

WORLD = 2
SEQ = 16


def _raw(zero_stage=0, accum=1, micro=2, **extra):
    raw = {"name": "t", "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4,
                                  "num_kv_heads": 2, "max_seq_len": 32},
           "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16},
           "loop": {"position": "middle"},
           "train": {"seq_len": SEQ, "micro_batch_size": micro, "gradient_accumulation_steps": accum,
                     "lr": 1e-2, "warmup_steps": 1, "max_steps": 10, "grad_clip": 1.0},
           "deepspeed": {"zero_stage": zero_stage}}
    for k, v in extra.items():
        raw[k] = {**raw.get(k, {}), **v}
    return raw


#: one forward and backward pass, a weight gradient summed over 4 x 16 tokens x 2 visits x 2 ranks
N_STEP = lm_chain_length(config_from_dict(_raw()), tokens=4 * SEQ * 2 * WORLD)


def _batch(step: int, rank: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch every step (per rank and micro-batch), so that the loss must fall."""
    g = torch.Generator().manual_seed(10 * rank + micro)
    w = torch.randint(0, 64, (size, SEQ + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def _engine(raw, world):
    """The engine exactly as training builds it (train.build: seeded with train.seed)."""
    from smelt_ds.train.build import build

    cfg = config_from_dict(raw)
    built = build(cfg, world)
    return cfg, built.engine, built.scheduler


def _ds_losses(rank, world, raw, steps):
    import torch.distributed as dist

    cfg, engine, sched = _engine(raw, world)
    losses, lrs = [], []
    accum = cfg.train.gradient_accumulation_steps
    for step in range(steps):
        tot = 0.0
        for m in range(accum):
            x, y = _batch(step, rank, m, cfg.train.micro_batch_size)
            out = engine(x, labels=y)
            loss = total_loss(out, cfg.train)
            engine.backward(loss)
            engine.step()
            tot += float(loss.detach()) / accum
        t = torch.tensor([tot])
        dist.all_reduce(t)
        losses.append(float(t) / world)
        lrs.append(sched.get_last_lr()[0])
    return losses, lrs


def _reference_losses(raw, steps, world=WORLD):
    cfg = config_from_dict(raw)
    torch.manual_seed(cfg.train.seed)  # the seed train.build uses
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    groups = param_groups(model, cfg)
    opt = torch.optim.AdamW(groups, lr=cfg.train.lr, betas=cfg.train.betas, eps=cfg.train.eps)
    f = lr_multiplier(cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s, sc=g["lr_scale"]: sc * f(s) for g in opt.param_groups])
    accum = cfg.train.gradient_accumulation_steps
    losses, lrs = [], []
    for step in range(steps):
        opt.zero_grad()
        tot = 0.0
        for r in range(world):
            for m in range(accum):
                x, y = _batch(step, r, m, cfg.train.micro_batch_size)
                loss = total_loss(model(x, labels=y), cfg.train) / (world * accum)
                loss.backward()
                tot += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        sched.step()
        losses.append(tot)
        lrs.append(sched.get_last_lr()[0])
    return losses, lrs


def _many(rank, world, fn, raws, *args):
    """Several configurations in one pair of processes (spawning costs more than a run)."""
    return [fn(rank, world, raw, *args) for raw in raws]


def test_zero_stages_match_single_process_pytorch():
    raws = [_raw(zero_stage=stage) for stage in (0, 1, 2, 3)]
    got = run_distributed(_many, WORLD, args=(_ds_losses, raws, 3))
    ref_losses, ref_lrs = _reference_losses(raws[0], 3)
    assert ref_losses[2] < ref_losses[0]  # it learns: a frozen model would also "match"
    for rank_results in got:
        for stage, (losses, lrs) in enumerate(rank_results):
            assert losses == pytest.approx(ref_losses, rel=prob_tol(3 * N_STEP)), f"ZeRO-{stage}"
            assert lrs == pytest.approx(ref_lrs, rel=1e-6), f"ZeRO-{stage}"


def test_looped_layers_with_activation_checkpointing():
    """Known failure kinds: 'gradient computed twice' for a reused parameter, stale parameters on
    the second iteration. ZeRO-2 and ZeRO-3 with the full and looped policies must match the
    reference without checkpointing over 3 steps."""
    cases = [(stage, policy) for stage in (2, 3) for policy in ("full", "looped")]
    raws = []
    for stage, policy in cases:
        raw = _raw(zero_stage=stage)
        raw["train"]["activation_checkpointing"] = {"policy": policy}
        raws.append(raw)
    got = run_distributed(_many, WORLD, args=(_ds_losses, raws, 3))
    ref_losses, _ = _reference_losses(_raw(zero_stage=0), 3)
    for rank_results in got:
        for case, (losses, _) in zip(cases, rank_results, strict=True):
            assert losses == pytest.approx(ref_losses, rel=prob_tol(3 * N_STEP)), case


def _full_grads(rank, world, raw):
    from deepspeed.utils import safe_get_full_grad

    cfg, engine, _ = _engine(raw, world)
    accum = cfg.train.gradient_accumulation_steps
    micro = cfg.train.micro_batch_size
    for m in range(accum):
        x, y = _batch(0, rank, 0, micro * accum)
        x, y = x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]
        out = engine(x, labels=y)
        engine.backward(total_loss(out, cfg.train))
        if m < accum - 1:
            engine.step()
    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    engine.step()
    return grads


def test_gradient_accumulation_equals_larger_batch():
    """k=2 micro-batches of 2 give the gradients of one micro-batch of 4, under ZeRO-2 and ZeRO-3.
    The Switch aux loss is not additive over batches (it multiplies batch means), so its
    coefficient is 0 here; the LM loss and the z-loss are token means and are."""
    common = {"train": {"aux_loss_coef": 0.0}}
    raws = [_raw(stage, accum=accum, micro=micro, **common) for stage in (2, 3) for accum, micro in ((2, 2), (1, 4))]
    got = run_distributed(_many, WORLD, args=(_full_grads, raws))[0]
    for stage, (acc, big) in zip((2, 3), (got[0:2], got[2:4]), strict=True):
        assert any(g.abs().sum() > 0 for g in big.values())
        for name, g in big.items():
            assert_close_chain(acc[name], g, N_STEP, msg=f"ZeRO-{stage} {name}")


def _zero3_release(rank, world, raw):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    cfg, engine, _ = _engine(raw, world)
    looped = engine.module.looped_parameter_names()
    gathered_after, live_bytes = [], []
    for step in range(5):
        x, y = _batch(step, rank, 0, cfg.train.micro_batch_size)
        out = engine(x, labels=y)
        engine.backward(total_loss(out, cfg.train))
        engine.step()
        gathered_after.append(sorted(n for n, p in engine.module.named_parameters()
                                     if n in looped and p.ds_status != ZeroParamStatus.NOT_AVAILABLE))
        del out
        gc.collect()
        live_bytes.append(sum(o.untyped_storage().nbytes() for o in gc.get_objects()
                              if isinstance(o, torch.Tensor) and not o.is_meta))
    return gathered_after, live_bytes, len(looped)


def test_zero3_releases_looped_parameters_and_memory_is_flat():
    raw = _raw(zero_stage=3)
    raw["deepspeed"]["zero3_loop_tuning"] = "off"
    # every tiny parameter is below the default persistence threshold, which keeps it gathered by
    # design; 0 makes every parameter subject to release
    raw["deepspeed"]["config"] = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    for gathered, live, n_looped in run_distributed(_zero3_release, WORLD, args=(raw,)):
        assert n_looped > 0
        assert gathered == [[]] * 5, gathered
        assert live[4] <= live[1], live  # no growth from step 2 to step 5


def _engine_error(rank, world, raw, passthrough):
    """The engine's error for ``raw`` with ``passthrough`` as ``deepspeed.config``, set after the
    recipe's checks (which refuse the keys a field owns): what reaches DeepSpeed unchecked."""
    from smelt_ds.errors import ConfigError
    from smelt_ds.train.build import build

    cfg = config_from_dict(raw)
    cfg = cfg.model_copy(update={"deepspeed": cfg.deepspeed.model_copy(update={"config": passthrough})})
    try:
        build(cfg, world)
    except ConfigError as e:
        return str(e)
    return None


def test_deepspeed_config_assertion_becomes_a_config_error():
    """A config DeepSpeed rejects with an assert (a train_batch_size that contradicts micro-batch x
    accumulation x world) is a ConfigError naming `deepspeed.config`, not a bare AssertionError."""
    msg = run_distributed(_engine_error, 1, args=(_raw(), {"train_batch_size": 3}), timeout=300)[0]
    assert msg is not None and "DeepSpeed refused" in msg and "`deepspeed.config`" in msg
    assert "train_batch_size is not equal" in msg          # DeepSpeed's own reason is kept
