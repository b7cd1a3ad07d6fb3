"""Text generation with the per-visit KV cache (:meth:`smelt_ds.model.SmeltLM.generate`) and its
speed.

``tokens_per_s`` = new tokens / wall-clock seconds of the whole ``generate`` call (prefill of
the prompt included), for batch size 1. The prompt goes to the model's device
(:func:`~smelt_ds.parallel.device.to_device`); sampling draws from
:func:`~smelt_ds.eval.device.sampling_generator` (on the model's device when it is CUDA).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from smelt_ds.errors import ConfigError
from smelt_ds.eval.device import sampling_generator
from smelt_ds.parallel.device import device_of, to_device

__all__ = ["GenerationResult", "encode_prompt", "generate_text"]


@dataclass
class GenerationResult:
    """One decoding: ``mode`` (``greedy`` or ``sampled``), ``prompt_tokens`` and ``new_tokens``
    (tokens), the decoded continuation ``text``, ``seconds`` (wall clock), ``tokens_per_s``
    (new tokens per second) and all ``ids`` (prompt + new)."""

    mode: str
    prompt_tokens: int
    new_tokens: int
    text: str
    seconds: float
    tokens_per_s: float
    ids: list[int]


def encode_prompt(tokenizer, prompt: str, eot_id: int) -> list[int]:
    """``[end-of-text] + ids(prompt)``: the document separator the model was trained after, so the
    prompt reads as the start of a document."""
    return [eot_id] + list(tokenizer.encode(prompt, add_special_tokens=False).ids)


@torch.no_grad()
def generate_text(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                  top_p: float = 1.0, seed: int = 0, eos_id: int | None = None) -> GenerationResult:
    """Decode up to ``max_new_tokens`` tokens after ``prompt_ids`` (greedy when ``temperature`` is
    0, else sampled with ``top_p``), stopping at ``eos_id``. Raises ConfigError when prompt plus new
    tokens exceed ``model.max_seq_len``."""
    limit = model.model_cfg.max_seq_len
    if len(prompt_ids) >= limit:
        raise ConfigError(f"the prompt ({len(prompt_ids)} tokens) leaves no room in `model.max_seq_len` ({limit}): "
                          f"shorten it to at most {limit - 1} tokens, keeping room for --max-new-tokens")
    if len(prompt_ids) + max_new_tokens > limit:
        raise ConfigError(f"`--max-new-tokens` ({max_new_tokens}) + prompt ({len(prompt_ids)} tokens) exceeds "
                          f"`model.max_seq_len` ({limit}): pass --max-new-tokens <= {limit - len(prompt_ids)} "
                          "or shorten the prompt")
    if max_new_tokens < 1:
        raise ConfigError(f"`--max-new-tokens` ({max_new_tokens}) must be >= 1")
    dev = device_of(model)
    gen = sampling_generator(dev, seed)
    (ids,) = to_device(dev, torch.tensor([prompt_ids], dtype=torch.long))
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens, temperature=temperature, top_p=top_p, eos_token_id=eos_id,
                         generator=gen)
    dt = time.perf_counter() - t0
    new = out[0, len(prompt_ids):].tolist()
    shown = new[:-1] if eos_id is not None and new and new[-1] == eos_id else new
    return GenerationResult("greedy" if temperature <= 0 else "sampled", len(prompt_ids), len(new),
                            tokenizer.decode(shown), dt, len(new) / dt if dt > 0 else float("inf"),
                            out[0].tolist())
