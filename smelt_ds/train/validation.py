"""In-loop validation: the loss per validation domain of the engine being trained (rank-collective).

``train.eval_every`` steps and at the end of a run, :func:`smelt_ds.train.loop.train` calls
:func:`evaluate`; its numbers go to ``metrics.jsonl`` (``val/<domain>``), TensorBoard and
``summary.txt``.
"""

from __future__ import annotations

import torch

from smelt_ds.config.run import RunConfig

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(engine, data, cfg: RunConfig) -> dict[str, float]:
    """Mean next-token loss (nats/token) per validation domain over up to ``eval.eval_batches``
    micro-batches per rank (token-weighted within a domain, summed over ranks); ``all`` is the
    plain mean of the domains' values, so every domain weighs the same whatever its number of
    windows (``smelt-ds eval``'s ``all`` instead pools the domains' tokens, and says so)."""
    import torch.distributed as dist

    engine.eval()
    out: dict[str, float] = {}
    for domain, batches in data.validation(cfg.eval.eval_batches).items():
        s = torch.zeros(2, dtype=torch.float64)
        for batch in batches:
            o = engine(batch.input_ids, labels=batch.labels)
            n = int((batch.labels != -100).sum())
            s += torch.tensor([float(o.lm_loss) * n, n], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(s)
        if s[1] > 0:
            out[domain] = float(s[0] / s[1])
    if out:
        out["all"] = sum(out.values()) / len(out)
    engine.train()
    return out
