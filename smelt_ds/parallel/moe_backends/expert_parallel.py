"""What the expert-parallel backends share: the decoder blocks whose FFN slot holds an MoE
(:func:`moe_blocks`) and DeepSpeed's expert-parallel groups (:func:`expert_parallel_rank`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["moe_blocks", "expert_parallel_rank"]


def moe_blocks(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """``(name, block)`` for every decoder block whose FFN slot holds an MoE."""
    for i, block in enumerate(getattr(model, "layers", [])):
        if getattr(block, "is_moe", False):
            yield f"layers.{i}", block


def expert_parallel_rank(ep_size: int, use_data_before_expert_parallel: bool = False) -> int:
    """This rank's index in its DeepSpeed expert-parallel group ``ep_size_{ep_size}``.

    Creates DeepSpeed's expert and expert-data groups if they do not exist yet (every rank must
    call this, in the same order), exactly as the engine would in ``deepspeed.initialize``.
    Raises RuntimeError when ``ep_size > 1`` and torch.distributed is not initialised.
    """
    if ep_size == 1:
        return 0
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError(f"moe_runtime.ep_size ({ep_size}) > 1 needs torch.distributed initialised before "
                           "apply_backend (e.g. deepspeed.init_distributed())")
    import deepspeed
    from deepspeed import comm as ds_dist
    from deepspeed.utils import groups

    if not ds_dist.is_initialized():
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)
    name = f"ep_size_{ep_size}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size,
                                                use_data_before_expert_parallel_=use_data_before_expert_parallel)
    return groups._get_expert_parallel_rank(name)
