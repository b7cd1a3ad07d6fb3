"""In-loop downstream evaluation: lm-evaluation-harness tasks on the model under training, every
``eval.harness_interval`` steps (OLMo-core's in-loop evaluator callback in spirit).

Recipe fields (:class:`smelt_ds.config.eval.EvalConfig`)::

    eval:
      harness_tasks: [lambada_local, code_next_line]   # task, group or tag names
      harness_interval: 500                            # steps
      harness_include_path: tasks/                     # e.g. from `smelt-ds eval build-tasks tasks/`
      harness_num_fewshot: 0
      harness_limit: 200                               # examples per task
      harness_batch_size: 8

How it runs on a sharded model. Under ZeRO-3 every rank holds a partition of each parameter, and
under expert parallelism (``moe_runtime.backend`` ``deepspeed`` or ``autoep``) each rank holds only
its experts, so no rank can run the training model alone. The harness therefore runs on a copy:

1. every rank gathers its shard of the reference-layout fp32 weights, as checkpoints do
   (:func:`smelt_ds.runs.reference_weights.gather_reference_shard`: DeepSpeed's
   ``safe_get_full_fp32_param`` at ZeRO 1-3, the parameter itself at ZeRO-0) - a collective,
   so every rank calls :func:`run_harness_eval` at the same step;
2. the shards travel to rank 0 (``gather_object``) and are merged and checked there
   (:func:`smelt_ds.runs.reference_weights.merge_shards`, the merge ``smelt-ds export`` uses);
3. rank 0 builds a reference-backend :class:`smelt_ds.model.SmeltLM` (``model``, ``moe``,
   ``loop`` of the run) with those weights, in fp32 on its device, and runs
   :func:`smelt_ds.eval.harness.evaluate_model` with the run's tokenizer (the prepared data's,
   which training copies into the run directory: :mod:`smelt_ds.runs.provenance`);
4. the other ranks wait for rank 0's result. They take no part in the forward passes, so there
   is no collective inside the evaluation that could hang when ranks would hold different
   numbers of examples, and the numbers are those of ``evaluate_model`` on the export of the
   same step (the export's ``model.pt`` is the same merged state dict).

The wait runs on a separate gloo process group with a long timeout
(:data:`HARNESS_WAIT_TIMEOUT`), so an evaluation longer than the training process group's timeout
(30 minutes by default, NCCL or gloo) does not kill the run; a failure on rank 0 is sent to the
other ranks, which raise too rather than wait.

The model under training is not touched: no forward pass, no gradient, its train/eval mode
unchanged; the RNG states (python, numpy, torch, CUDA) are restored after the evaluation, which
reseeds them (lm-eval's ``simple_evaluate``), so the next training step is the one a run without
in-loop evaluation takes. Memory: rank 0 holds one fp32 copy of the model (4 bytes per parameter,
all experts) on its device while the evaluation runs; when it saves a checkpoint at the same
step, the weights are gathered a second time by the checkpoint.

Logged (rank 0 only): one ``metrics.jsonl`` row per evaluation, ``{"step", "tokens",
"harness/<task>/<metric>": value, ..., "harness/seconds"}``, and the same values as TensorBoard
scalars (:class:`smelt_ds.train.metrics.MetricsWriter`). Metric names are lm-eval's with the
default filter's ``,none`` removed (as lm-eval's own W&B logger names them), e.g.
``harness/lambada_local/acc``, ``harness/lambada_local/perplexity``; other filters keep their
``,filter`` suffix. String and non-finite values (an ``N/A`` stderr) are not logged.
"""

from __future__ import annotations

import datetime
import math
import sys
import time
from typing import Any

import torch

from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError
from smelt_ds.eval.harness import evaluate_model, task_manager
from smelt_ds.model import SmeltLM
from smelt_ds.parallel import control
from smelt_ds.runs.checkpoint import restore_rng, rng_state
from smelt_ds.runs.reference_weights import gather_reference_shard, merge_shards
from smelt_ds.train.metrics import MetricsWriter

__all__ = ["HARNESS_WAIT_TIMEOUT", "harness_due", "check_harness_tasks", "gather_reference_state",
           "reference_model", "harness_metrics", "run_harness_eval"]

#: how long ranks other than 0 wait for rank 0's in-loop harness evaluation (a gloo group's timeout)
HARNESS_WAIT_TIMEOUT = datetime.timedelta(hours=12)


def harness_due(cfg: RunConfig, step: int) -> bool:
    """Whether optimizer step ``step`` (1-based, after the step) runs the in-loop harness
    evaluation: ``eval.harness_tasks`` set and ``step`` a multiple of ``eval.harness_interval``."""
    ev = cfg.eval
    return bool(ev.harness_tasks) and ev.harness_interval is not None and step % ev.harness_interval == 0


def check_harness_tasks(cfg: RunConfig) -> None:
    """Check that every name in ``eval.harness_tasks`` is a task, group or tag lm-evaluation-harness
    knows (``eval.harness_include_path``'s task YAMLs, then lm-eval's own), before training starts
    rather than at the first evaluation. Reads the task index only, no dataset. Run it on one rank
    (lm-eval indexes about 15k YAMLs in tens of seconds when the include path does not hold every
    name); the index is cached for the evaluations (:func:`smelt_ds.eval.harness.task_manager`).

    Raises ConfigError naming ``eval.harness_tasks`` and the unknown names."""
    if not cfg.eval.harness_tasks:
        return
    try:
        task_manager(list(cfg.eval.harness_tasks), cfg.eval.harness_include_path)
    except ConfigError as e:
        raise ConfigError(f"`eval.harness_tasks` ({cfg.eval.harness_tasks}): {e}; or set "
                          "eval.harness_include_path to the directory of their task YAMLs") from None


def gather_reference_state(engine, cfg: RunConfig, group=None) -> dict[str, torch.Tensor] | None:
    """The reference-layout fp32 state dict of the live ``engine``, on global rank 0 (None elsewhere).

    Collective: every rank calls it at the same step. Each rank gathers its shard
    (:func:`gather_reference_shard`), the shards are sent to rank 0 with ``gather_object`` over
    ``group`` (default: the world) and merged there (:func:`merge_shards`: every tensor of the
    reference :class:`SmeltLM` once, every expert index once). Tensors are fp32 CPU, shapes those of
    the reference model's state dict (``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``).

    Raises ConfigError (rank 0) when the shards do not make up the reference model."""
    import torch.distributed as dist

    shard = gather_reference_shard(engine, cfg.moe_runtime.backend)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return merge_shards([shard], cfg, "the live engine")
    rank = dist.get_rank()
    shards: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(shard if rank != 0 else None, shards, dst=0,
                       group=group if group is not None else control.control_group())  # rank 0's stays in place
    if rank != 0:
        return None
    assert shards is not None
    shards[0] = shard
    return merge_shards(shards, cfg, "the live engine")


def reference_model(state: dict[str, torch.Tensor], cfg: RunConfig, device: str | torch.device = "cpu") -> SmeltLM:
    """A reference-backend :class:`SmeltLM` (``cfg.model``, ``cfg.moe``, ``cfg.loop``) holding
    ``state`` (a full reference-layout state dict), fp32 on ``device``, in eval mode, without
    gradients. Consumes torch's RNG (initialisation before the weights are loaded)."""
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    model.load_state_dict(state)
    return model.to(device).eval().requires_grad_(False)


def harness_metrics(results: dict[str, Any]) -> dict[str, float]:
    """``{"harness/<task>/<metric>": value}`` from lm-eval's ``simple_evaluate`` results dict
    (``results["results"][task]["<metric>,<filter>"]``): numeric, finite values only; the
    default filter's ``,none`` removed, as lm-eval's W&B logger does (``remove_none_pattern``)."""
    from lm_eval.loggers.utils import remove_none_pattern

    out: dict[str, float] = {}
    for task, metrics in (results.get("results") or {}).items():
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            out[f"harness/{task}/{remove_none_pattern(key)[0]}"] = float(value)
    return out


def _gather_and_evaluate(engine, cfg: RunConfig, prepared, group) -> dict[str, float] | None:
    """Steps 1-3 of the module docstring: the metrics on rank 0, None on the other ranks."""
    state = gather_reference_state(engine, cfg, group)
    if state is None:
        return None
    model = reference_model(state, cfg, _compute_device())
    del state  # the model holds its own copy
    ev = cfg.eval
    with torch.no_grad():
        results = evaluate_model(model, prepared.tokenizer(), prepared.eot_id, list(ev.harness_tasks),
                                 include_path=ev.harness_include_path, num_fewshot=ev.harness_num_fewshot,
                                 limit=ev.harness_limit, batch_size=ev.harness_batch_size)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return harness_metrics(results)


def _compute_device() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def run_harness_eval(engine, cfg: RunConfig, prepared, step: int, tokens_seen: int,
                     writer: MetricsWriter | None = None) -> dict[str, float]:
    """Run ``eval.harness_tasks`` on the model of ``engine`` at ``step`` and log the metrics.

    Collective: every rank calls it at the same step (see the module docstring: the weights are
    gathered on rank 0, which alone runs the harness; the others wait, taking no part in the
    forward passes, so uneven numbers of examples cannot hang). Neither the engine's model, its
    mode, its gradients nor the RNG states change.

    Args:
        engine: the ``deepspeed.DeepSpeedEngine`` under training (any ZeRO stage, any MoE backend).
        cfg: the run's config (``eval.harness_*``, the architecture, ``moe_runtime.backend``).
        prepared: the run's :class:`smelt_ds.data.prepare.PreparedData` (its tokenizer and
            end-of-text id: the tokenizer the run trains with).
        step: optimizer steps done; tokens_seen: training tokens so far (both logged).
        writer: the run's metrics writer (writes on rank 0 only); None logs nothing.

    Returns:
        ``{"harness/<task>/<metric>": value}`` (see :func:`harness_metrics`) plus
        ``harness/seconds`` (wall-clock seconds of the whole evaluation, gather included), on every rank.

    Raises:
        ConfigError: on every rank, for a configuration problem rank 0 met (a task that cannot be
            loaded, weights that do not fit the recipe).
        RuntimeError: on every rank other than 0 when rank 0's evaluation failed otherwise (rank 0
            raises the original error).
    """
    import torch.distributed as dist

    t0 = time.perf_counter()
    rng = rng_state()
    multi = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    group = dist.new_group(backend="gloo", timeout=HARNESS_WAIT_TIMEOUT) if multi else None
    try:
        metrics, error, exc = None, None, None
        try:
            metrics = _gather_and_evaluate(engine, cfg, prepared, group)
        except Exception as e:  # noqa: BLE001 - sent to the other ranks, then raised everywhere
            exc, error = e, (type(e).__name__, str(e))
        if multi:
            box = [(metrics, error)]
            dist.broadcast_object_list(box, src=0, group=group)
            metrics, error = box[0]
        if exc is not None:
            raise exc
        if error is not None:
            if error[0] == "ConfigError":
                raise ConfigError(error[1])
            raise RuntimeError(f"rank 0's in-loop harness evaluation at step {step} failed: {error[0]}: {error[1]}")
    finally:
        if group is not None:
            dist.destroy_process_group(group)
        restore_rng(rng)
    assert metrics is not None
    metrics = {**metrics, "harness/seconds": time.perf_counter() - t0}
    if writer is not None:
        writer.write(step, {"tokens": tokens_seen, **metrics})
    if rank == 0:
        shown = ", ".join(f"{k.removeprefix('harness/')} {v:.4g}" for k, v in metrics.items()
                          if "_stderr" not in k and k != "harness/seconds")
        print(f"\nharness eval at step {step}: {shown} ({metrics['harness/seconds']:.1f} s)", file=sys.stderr)
    return metrics
