"""Shared pieces of the MoE-backend tests (tests/parallel/moe_backends/): the tiny model, its batches,
the tolerances derived from it, DeepSpeed configs and the single-process reference runs.

Tiny model everywhere: hidden 32, 4 unique layers with the middle two looped (plan 0 1 2 1 2 3),
4 experts, top-2, expert size 16, sequences of 16 tokens, micro-batch 2 per rank. Distributed
tests spawn 2 real gloo ranks through :func:`smelt_ds.testing.run_distributed`; the reference is
a single process that runs each rank's shard of the same global batch and averages the losses
(what data parallelism computes, the aux loss included: it is per rank in both).
"""

from __future__ import annotations

import torch

from smelt_ds.config.loading import config_from_dict
from smelt_ds.config.moe import MoERuntimeConfig
from smelt_ds.config.train import TrainConfig
from smelt_ds.model import SmeltLM
from smelt_ds.parallel.moe_backends.deepspeed_moe import DeepSpeedMoE
from smelt_ds.train.objective import total_loss
from tests.numerics import lm_chain_length, prob_tol

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
    """The reference-backend model of ``cfg`` initialised from ``seed``."""
    torch.manual_seed(seed)
    return SmeltLM(cfg.model, cfg.moe, cfg.loop)


def ds_config(stage: int, **extra) -> dict:
    """A DeepSpeed config of ZeRO ``stage`` for one micro-batch per step, no clipping."""
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


def expert_tensors(mlp: DeepSpeedMoE, ep_rank: int, attr: str) -> dict:
    """``{(global expert): cat(gate, up, down^T)}`` of a DeepSpeedMoE's local experts (``attr`` =
    ``"grad"`` or ``"data"``)."""
    first = ep_rank * (mlp.num_experts // mlp.ep_size)
    return {first + j: torch.cat([getattr(e.gate_proj.weight, attr), getattr(e.up_proj.weight, attr),
                                  getattr(e.down_proj.weight, attr).t()]).detach().clone()
            for j, e in enumerate(mlp.local_experts)}
