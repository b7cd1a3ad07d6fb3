"""The SMELT model in pure PyTorch (no DeepSpeed import): attention, MoE, looping, the LM."""

from smelt_ds.model.attention import KVCache
from smelt_ds.model.lm import LMOutput, SmeltLM, VisitRecorder, routing_divergence
from smelt_ds.model.looping import LoopingBlockManager, LoopSchedule, LoopSpan, Visit, VisitContext
from smelt_ds.model.moe import MoE

__all__ = ["KVCache", "LMOutput", "SmeltLM", "VisitRecorder", "routing_divergence", "LoopingBlockManager",
           "LoopSchedule", "LoopSpan", "Visit", "VisitContext", "MoE"]
