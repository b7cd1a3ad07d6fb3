"""What a training run logs: per-step means over micro-batches and ranks, routing statistics,
throughput and MFU, ``metrics.jsonl`` + TensorBoard rows (rank 0), and ``summary.json`` / ``summary.txt``.

Units: losses in nats/token, throughput in tokens/s, TFLOP/s per device, memory in bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from smelt_ds.config.run import RunConfig

__all__ = ["RunResult", "PEAK_TFLOPS", "device_peak_tflops", "memory_bytes", "MicroStats", "routing_metrics", "MetricsWriter",
           "write_summary"]


# Dense bf16 peak TFLOP/s per device (no sparsity), from the vendors' datasheets.
PEAK_TFLOPS = {
    "H100": 989.0,  # NVIDIA H100 SXM5 datasheet, BF16 Tensor Core (dense)
    "H200": 989.0,  # NVIDIA H200 datasheet (same compute as H100 SXM)
    "A100": 312.0,  # NVIDIA A100 datasheet, BF16 Tensor Core (dense)
    "B200": 2250.0,  # NVIDIA DGX B200 datasheet, per-GPU dense BF16
}


def device_peak_tflops() -> float | None:
    """Peak dense bf16 TFLOP/s of the current CUDA device, or None (unknown device or CPU)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def memory_bytes() -> int:
    """Peak CUDA memory allocated (bytes), or this process's resident set size on CPU."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import psutil

    return int(psutil.Process().memory_info().rss)


@dataclass
class MicroStats:
    """Sums over micro-batches since the last log row (means are taken over micro-batches)."""

    n: int = 0
    sums: dict[str, float] = field(default_factory=dict)

    def add(self, out, loss: torch.Tensor) -> None:
        """Add one micro-batch: ``loss`` is the training objective
        (:func:`smelt_ds.train.objective.total_loss`), ``out`` the model's ``LMOutput`` (its
        unweighted ``lm_loss``, ``aux_loss``, ``z_loss``)."""
        self.n += 1
        for k, v in (("loss", loss), ("lm_loss", out.lm_loss), ("aux_loss", out.aux_loss), ("z_loss", out.z_loss)):
            if v is not None:
                self.sums[k] = self.sums.get(k, 0.0) + float(v.detach())

    def means(self) -> dict[str, float]:
        """Means over this rank's micro-batches, then over data-parallel ranks (all-reduce)."""
        import torch.distributed as dist

        keys = sorted(self.sums)
        t = torch.tensor([self.sums[k] / max(1, self.n) for k in keys], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
            t /= dist.get_world_size()
        self.n, self.sums = 0, {}
        return dict(zip(keys, t.tolist()))


def routing_metrics(model) -> dict[str, float]:
    """``router/L{l}V{v}/load_max_over_mean`` and ``router/L{l}/divergence_{a}{b}`` of the last
    micro-batch on this rank."""
    rec = getattr(model, "recorder", None)
    if rec is None:
        return {}
    out = {}
    for visit, s in rec.router_stats().items():
        out[f"router/L{visit.layer}V{visit.visit}/load_max_over_mean"] = s["load_max_over_mean"]
        out[f"router/L{visit.layer}V{visit.visit}/dropped_share"] = s["dropped_share"]
    for (layer, a, b), d in rec.divergence().items():
        out[f"router/L{layer}/divergence_v{a}v{b}"] = d
    return out


class MetricsWriter:
    """``metrics.jsonl`` rows and TensorBoard scalars, written by rank 0 only."""

    def __init__(self, run_dir: Path, enabled: bool, start_step: int):
        """``start_step``: the step training continues from (0 for a new run). Rows logged after
        it by an earlier, interrupted invocation are dropped from ``metrics.jsonl`` (rewritten
        atomically) and hidden in TensorBoard (``SummaryWriter(purge_step=start_step + 1)``), so a
        resumed run's logs hold each step once."""
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1)
            if self.path.exists():
                keep = [line for line in self.path.read_text().splitlines()
                        if start_step and line.strip() and json.loads(line).get("step", 0) <= start_step]
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(line + "\n" for line in keep))
                os.replace(tmp, self.path)

    def write(self, step: int, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **row}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for k, v in row.items():
            if isinstance(v, (int, float)) and k != "step":
                assert self.tb is not None  # created when enabled
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()


@dataclass
class RunResult:
    """What :func:`train` returns (rank-local view, reduced values where noted)."""

    run_dir: Path
    step: int
    tokens_seen: int
    losses: list[float]  # loss per optimizer step (mean over micro-batches and ranks)
    lrs: list[float]
    val: dict[str, float]
    sample_ids: list[list[int]]  # per optimizer step, this rank's sample ids (data order checks)
    stopped_early: bool = False
    stop_reason: str | None = None  # "signal" (SIGTERM/SIGINT on any rank) or "exit_after_steps"


def write_summary(out_dir: Path, cfg: RunConfig, result: RunResult, budget, data) -> None:
    metrics = [json.loads(l) for l in (out_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    last: dict[str, Any] = next((m for m in reversed(metrics) if "loss" in m), {})
    tps = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m]
    summary = {
        "name": cfg.name, "steps": result.step, "tokens": result.tokens_seen,
        "final_train_loss": last.get("loss"), "final_lm_loss": last.get("lm_loss"),
        "validation_loss": result.val, "tokens_per_s": (sum(tps) / len(tps)) if tps else None,
        "unigram_entropy_nats": getattr(data, "unigram_entropy", None),
        "budget": budget.as_dict(),
    }
    tmp = out_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out_dir / "summary.json")
    lines = [f"run {cfg.name}: {result.step} steps, {result.tokens_seen:,} tokens, "
             f"{summary['tokens_per_s'] or 0:,.0f} tokens/s",
             f"final train loss {summary['final_train_loss']:.4f} (LM {summary['final_lm_loss']:.4f})"]
    for k, v in result.val.items():
        lines.append(f"validation loss [{k}]: {v:.4f} nats/token"
                     + (" (domains weighted equally, eval.eval_batches each)" if k == "all" else ""))
    if summary["unigram_entropy_nats"] is not None:
        lines.append(f"unigram entropy of the training tokens: {summary['unigram_entropy_nats']:.4f} nats/token")
    lines.append(f"budgets: {budget.forward_flops_per_token:,.0f} forward FLOPs/token, "
                 f"{budget.non_embedding_params:,} non-embedding params (embedding and head excluded), "
                 f"{budget.kv_cache_bytes_per_token} KV-cache bytes/token ({budget.kv_dtype}), "
                 f"{budget.visits} visits of {budget.unique_layers} unique layers")
    text = "\n".join(lines)
    (out_dir / "summary.txt").write_text(text + "\n")
    print(text)
