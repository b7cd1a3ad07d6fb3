"""The files a save writes for a layout, for tests that fabricate checkpoints without training.

DeepSpeed 0.19's names (``DeepSpeedEngine._get_ckpt_name``, ``_get_zero_ckpt_name``,
``_get_expert_ckpt_name``, ``_get_optimizer_ckpt_name``; every rank is data-parallel rank = global
rank here, model-parallel rank 0) and smelt-ds's own (``client_rank{r}.pt``,
``reference/rank{r:05d}.pt``), as real saves of the tiny recipes wrote them:

- 2 ranks, ZeRO-1, reference: ``client_rank{0,1}.pt``, ``mp_rank_00_model_states.pt``,
  ``zero_pp_rank_{0,1}_mp_rank_00_optim_states.pt``, ``reference/rank0000{0,1}.pt``;
- 2 ranks, ZeRO-3, AutoEP EP 2: ``zero_pp_rank_{0,1}_mp_rank_00_model_states.pt`` instead of
  ``mp_rank_00_model_states.pt``;
- DeepSpeed-MoE or AutoEP below ZeRO-3: ``layer_{l}_expert_{e}_mp_rank_00_model_states.pt`` for
  every MoE layer and expert, and at ZeRO-0 ``expp_rank_{p}_mp_rank_00_optim_states.pt`` per
  expert-parallel rank (no ZeRO optimizer partitions).

bf16 (GPU) prefixes the ZeRO optimizer partitions with ``bf16_``.
"""

from __future__ import annotations


def layout_files(world: int, zero: int, backend: str = "reference", ep: int = 1, reference: bool = True,
                 moe_layers: int = 0, experts: int = 0, bf16: bool = False) -> list[str]:
    """The sorted relative paths of a checkpoint's files written by ``world`` ranks at ZeRO stage
    ``zero`` with MoE backend ``backend`` and expert-parallel size ``ep``; with ``reference``, the
    reference shards; ``moe_layers`` x ``experts``: the expert files of an expert-parallel backend."""
    names = [f"client_rank{r}.pt" for r in range(world)]
    names += ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)] if zero == 3
              else ["mp_rank_00_model_states.pt"])
    if zero >= 1:
        names += [f"{'bf16_' if bf16 else ''}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    if backend != "reference" and zero < 3 and moe_layers:
        names += [f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in range(moe_layers)
                  for e in range(experts)]
        if zero == 0:
            names += [f"expp_rank_{p}_mp_rank_00_optim_states.pt" for p in range(ep)]
    if reference:
        names += [f"reference/rank{r:05d}.pt" for r in range(world)]
    return sorted(names)


def writer(name: str) -> int:
    """The rank that writes file ``name`` (rank 0 for the files one rank writes for all)."""
    for prefix in ("client_rank", "zero_pp_rank_", "bf16_zero_pp_rank_", "reference/rank"):
        if name.startswith(prefix):
            return int(name[len(prefix):].split("_")[0].split(".")[0])
    return 0
