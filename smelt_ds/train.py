"""The training loop. Runs under the ``deepspeed`` launcher or as one plain process.

    deepspeed [--num_gpus N | --hostfile H] --module smelt_ds.train RECIPE [--set k=v ...]
    smelt-ds train RECIPE [--set k=v ...] [--nproc N] [--resume auto]

The run directory (``train.run_dir``) receives the resolved recipe (``config.yaml``), the final
DeepSpeed config (``ds_config.json``), TensorBoard events (``tb/``), ``metrics.jsonl``,
checkpoints (``checkpoints/<tag>/``), ``zero3_tuning.json`` (ZeRO-3 runs: the loop-aware
prefetch/persistence values chosen from the visit plan) and ``summary.json`` / ``summary.txt`` at
the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from smelt_ds.budget import compute_budget
from smelt_ds.checkpoint import CheckpointWriteError
from smelt_ds.config import RunConfig, dump_config, load_config
from smelt_ds.errors import ConfigError
from smelt_ds.provenance import init_from_tokenizer, record_run_tokenizer, tokenizer_file_hash
from smelt_ds.testing.distributed import find_free_port

__all__ = ["main", "train", "build", "Built", "parse_args", "RunResult"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="smelt_ds.train", description="Train a SMELT or Baseline recipe.")
    add_train_arguments(p)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe, e.g. recipes/tiny/smelt.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field (YAML value), e.g. --set train.max_steps=20")
    p.add_argument("--resume", default="none",
                   help="'auto' continues from the latest complete checkpoint of the run directory, "
                        "'none' starts fresh, or a checkpoint directory")
    p.add_argument("--run-dir", default=None, help="override train.run_dir")


# ---------------------------------------------------------------------------------------------
# distributed setup
# ---------------------------------------------------------------------------------------------


def launcher_command(args: argparse.Namespace) -> list[str]:
    """The deepspeed launcher command line for ``--nproc N``."""
    # the launcher of *this* interpreter (a bare `deepspeed` on PATH may belong to another env)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.nproc),
           "--master_port", str(find_free_port()),
           "--module", "smelt_ds.train", args.recipe, "--resume", args.resume]
    for s in args.set:
        cmd += ["--set", s]
    if args.run_dir:
        cmd += ["--run-dir", args.run_dir]
    return cmd


def init_distributed() -> tuple[int, int, int]:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU, NCCL on CUDA) when launched
    with several ranks, or as a world of one. Returns ``(rank, local_rank, world_size)``."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(find_free_port())
    backend = "gloo" if get_accelerator().device_name() == "cpu" else get_accelerator().communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend)
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    return dist.get_rank(), local_rank, dist.get_world_size()


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------

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

    def add(self, out) -> None:
        self.n += 1
        for k in ("loss", "lm_loss", "aux_loss", "z_loss"):
            v = getattr(out, k)
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


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------


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


class _Terminator:
    """SIGTERM/SIGINT -> finish the current step, save a checkpoint, exit cleanly."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict[signal.Signals, Any] = {}

    def __enter__(self):
        if threading_is_main():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, h in self._old.items():
            signal.signal(sig, h)


# recipe fields a checkpoint depends on: a resume with other values cannot load it, or would
# silently change what the run computes (token ids, routing)
_RESUME_FIXED = {"model": None, "loop": None,
                 "moe": ("num_experts", "top_k", "expert_ffn_size", "shared_expert_ffn_size", "score_func",
                         "aux_loss_free_bias", "backend", "ep_size")}


def check_run_dir(out_dir: Path, cfg: RunConfig, resume: str, world_size: int | None = None) -> None:
    """Refuse to mix runs in one run directory, before anything is written to it.

    Raises ConfigError when a new run (``resume == "none"``) would start in a directory that
    already holds checkpoints (they would be taken for this run's by export, eval and
    ``--resume auto``); when ``--resume`` names a directory that does not exist, a checkpoint of
    another run directory, or one older than the run's newest (a rewind would mix the newer
    checkpoints into this run); or when a resumed run's recipe differs from the run directory's ``config.yaml`` in a field the
    checkpoint depends on (``_RESUME_FIXED``: model, loop, MoE layout and backend, tokenizer); or,
    when ``world_size`` is given, when the checkpoint to resume was written with another number
    of ranks, ZeRO stage, MoE backend or expert-parallel size (:func:`smelt_ds.checkpoint.check_layout`).
    """
    from smelt_ds import checkpoint as ckpt
    from smelt_ds.config import config_diff, config_to_dict

    damaged = sorted(p.name for p in ckpt.checkpoint_dir(out_dir).glob("damaged-step*"))
    if resume == "none":
        latest = ckpt.latest_complete(out_dir)
        if latest is not None or damaged:
            held = f"newest {latest.name}" if latest is not None else f"only damaged ones: {', '.join(damaged[:3])}"
            raise ConfigError(f"run directory {out_dir} already holds checkpoints of an earlier run ({held}): "
                              "continue it with --resume auto, or start this run in a new --run-dir (or delete "
                              "the old one)")
        return
    if resume == "auto" and ckpt.latest_complete(out_dir) is None and damaged:
        raise ConfigError(f"--resume auto: run directory {out_dir} holds no checkpoint that verifies, only damaged "
                          f"ones ({', '.join(damaged[:3])}): nothing to continue from; start a new run in a new "
                          "--run-dir (the damaged checkpoints are kept for inspection)")
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise ConfigError(f"--resume {resume!r} does not exist: pass a checkpoint directory "
                              f"({out_dir}/checkpoints/stepNNNNNNNN) or --resume auto")
        owner = path.resolve().parent.parent
        if owner != out_dir.resolve():
            raise ConfigError(f"--resume {resume}: the checkpoint belongs to run directory {owner}, not to "
                              f"{out_dir}: resume it there (--run-dir {owner}), or start a new run from its "
                              "weights with `smelt-ds export` and train.init_from")
        latest = ckpt.latest_complete(out_dir)
        if latest is not None and latest.name > path.name:
            raise ConfigError(f"--resume {resume} is older than the run's newest checkpoint {latest.name}: to "
                              "rewind, first move the newer checkpoints out of checkpoints/ (otherwise they are "
                              "pruned by train.keep_last or mixed into this run), or resume with --resume auto")
    target = ckpt.latest_complete(out_dir) if resume == "auto" else Path(resume)
    if world_size is not None and target is not None and (target / ckpt.MARKER).is_file():
        ckpt.check_layout(target, ckpt.run_layout(cfg, world_size))
    saved = out_dir / "config.yaml"
    if not saved.is_file() or (resume == "auto" and ckpt.latest_complete(out_dir) is None):
        return
    import yaml

    old, new = yaml.safe_load(saved.read_text()) or {}, config_to_dict(cfg)
    _same_tokenizer_same_path(old, new)
    diffs = []
    for section, keys in _RESUME_FIXED.items():
        a, b = new.get(section) or {}, old.get(section) or {}
        if keys is not None:
            a, b = {k: a.get(k) for k in keys}, {k: b.get(k) for k in keys}
        diffs += config_diff(a, b, section, labels=("in this recipe", "in the run"))
    if diffs:
        raise ConfigError(f"--resume {resume}: run directory {out_dir} was trained with another model "
                          f"({'; '.join(diffs[:4])}): resume with the run's own recipe ({saved}), or start "
                          "this recipe in a new --run-dir")
    _check_resume_overrides(old, new, out_dir, resume)


# what a resume may change: how long, how often to log/evaluate/save, where data are cached, and
# evaluation settings; everything else would change the optimisation it continues (the LR, the
# batch, the data) while the checkpoint restores the old state, so config.yaml would lie
RESUME_MAY_CHANGE = ("name", "train.max_steps", "train.log_every", "train.eval_every", "train.save_every",
                     "train.keep_last", "train.exit_after_steps", "train.run_dir", "train.init_from", "eval",
                     "cluster", "data.num_proc", "data.cache_dir", "data.output_dir", "data.offline", "data.verify",
                     "data.shared_filesystem", "data.prepare_timeout_s", "deepspeed.comms_logger")


def _same_tokenizer_same_path(old: dict, new: dict) -> None:
    """The tokenizer is compared by content on resume (:func:`smelt_ds.provenance.record_run_tokenizer`
    names both digests): a copy of the run's tokenizer under another path is the same tokenizer."""
    a = (old.get("data") or {}).get("tokenizer") or {}
    b = (new.get("data") or {}).get("tokenizer") or {}
    if a.get("path") and b.get("path") and a["path"] != b["path"]:
        if Path(a["path"]).is_file() and Path(b["path"]).is_file() and \
                tokenizer_file_hash(a["path"]) == tokenizer_file_hash(b["path"]):
            b["path"] = a["path"]  # b is new's own dict: compared as the run's path from here on


def _check_resume_overrides(old: dict, new: dict, out_dir: Path, resume: str) -> None:
    """Raise ConfigError naming every field outside :data:`RESUME_MAY_CHANGE` whose value differs
    from the run's ``config.yaml`` (fields the saved file lacks are not compared)."""
    from smelt_ds.config import config_diff

    def allowed(path: str) -> bool:
        return any(path == p or path.startswith(p + ".") for p in RESUME_MAY_CHANGE)

    diffs = [d for d in config_diff(_common(new, old), _common(old, new), labels=("in this recipe", "in the run"))
             if not allowed(d.split(":", 1)[0])]
    if diffs:
        raise ConfigError(f"--resume {resume}: {'; '.join(diffs[:4])} (run directory {out_dir}): a resume continues "
                          "the run's optimisation from its checkpoint and may change only "
                          f"{', '.join(RESUME_MAY_CHANGE[1:8])}, eval.* and data caching: resume with the run's "
                          "values, or start a new run from its weights (`smelt-ds export` then train.init_from)")


def _common(a: Any, b: Any) -> Any:
    """``a`` restricted to the keys ``b`` also has (recursively): fields added since ``b`` was written."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _common(v, b[k]) for k, v in a.items() if k in b}
    return a


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


@dataclass
class Built:
    """What :func:`build` returns: the model (after the MoE backend), the DeepSpeed engine, its
    LR scheduler, the final DeepSpeed config and the checkpoint layout."""

    model: Any
    engine: Any
    scheduler: Any
    ds_config: dict[str, Any]
    layout: dict[str, Any]


def build(cfg: RunConfig, world_size: int) -> Built:
    """Model + MoE backend + activation checkpointing + DeepSpeed engine, as training runs it.

    Collective: every rank calls it after torch.distributed is initialised. Seeds torch with
    ``train.seed`` first, then loads ``train.init_from`` (an export) if set. Raises ConfigError
    for a recipe the backend or DeepSpeed refuses, or an unusable ``train.init_from``.
    """
    from smelt_ds import checkpoint as ckpt
    from smelt_ds.engine import configure_activation_checkpointing, initialize
    from smelt_ds.model import SmeltLM

    torch.manual_seed(cfg.train.seed)
    model = SmeltLM(cfg)
    if cfg.train.init_from:  # a checkpoint loaded by --resume replaces these weights
        from smelt_ds.export import load_initial_weights

        load_initial_weights(model, cfg.train.init_from)
    if cfg.moe.backend != "reference":
        from smelt_ds.moe_backends import apply_backend

        model = apply_backend(model, cfg)
    configure_activation_checkpointing(model, cfg)
    engine, _, sched, ds_config = initialize(cfg, model, world_size)
    return Built(model, engine, sched, ds_config, ckpt.run_layout(cfg, world_size))


def _lock_run_dir(out_dir: Path, rank: int):
    """Rank 0 takes the run directory's exclusive lock (:class:`smelt_ds.run_lock.RunLock`);
    every rank raises the same ConfigError when another training holds it (collective).
    Returns ``(lock or None, created)``: whether this call created the directory."""

    from smelt_ds.run_lock import RunLock

    created = not out_dir.exists()
    lock = on_rank0(rank, lambda: RunLock(out_dir).acquire())
    return lock, created


def on_rank0(rank: int, fn):
    """``fn()`` on global rank 0 (its result there, None elsewhere); a ConfigError it raises is
    raised on every rank, so no rank waits in a collective for a rank that gave up."""
    import torch.distributed as dist

    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except ConfigError as e:
            error = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ConfigError(error)
    return result


def _remove_if_only_lock(out_dir: Path) -> None:
    """A refused run leaves no directory behind that it created (only its lock file is in it)."""
    from smelt_ds.run_lock import LOCK_NAME

    if out_dir.is_dir() and {p.name for p in out_dir.iterdir()} <= {LOCK_NAME}:
        import shutil

        shutil.rmtree(out_dir, ignore_errors=True)


def train(cfg: RunConfig, resume: str = "none", run_dir: str | None = None) -> RunResult:
    """Train ``cfg`` and return a :class:`RunResult`. Initialises torch.distributed if needed.

    Rank 0 holds the run directory's exclusive lock for the whole run (one writer per run).
    Raises ConfigError for bad configuration, incompatible data, an unusable checkpoint, or a
    run directory another training is using.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    out_dir = Path(run_dir or cfg.train.run_dir.format(name=cfg.name))
    if run_dir is not None:  # config.yaml says where the run lives, so the recipe resumes it as it is
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"run_dir": str(run_dir)})})
    cfg = init_from_tokenizer(cfg)  # a run started from an export trains on with its tokenizer
    lock, created = _lock_run_dir(out_dir, rank)
    try:
        check_run_dir(out_dir, cfg, resume, world)
        dist.barrier()
        return _train_in(cfg, resume, out_dir, rank, world)
    except ConfigError:
        if rank == 0 and created and lock is not None:  # a refused new run leaves no directory behind
            lock.release()
            lock = None
            _remove_if_only_lock(out_dir)
        raise
    finally:
        if lock is not None:
            lock.release()


def _train_in(cfg: RunConfig, resume: str, out_dir: Path, rank: int, world: int) -> RunResult:
    """The body of :func:`train`, in a locked, checked run directory."""
    from smelt_ds import checkpoint as ckpt
    from smelt_ds.engine import resolve_precision
    from smelt_ds.train_data import build_data

    torch.manual_seed(cfg.train.seed)
    data = build_data(cfg, rank, world)
    built = build(cfg, world)  # before anything is written: a recipe the engine refuses leaves no trace
    on_rank0(rank, lambda: record_run_tokenizer(out_dir, data.prepared, resuming=resume != "none"))
    model, engine, ds_config = built.model, built.engine, built.ds_config
    if rank == 0 and ds_config.get("zero_optimization", {}).get("stage") == 3:  # loop-aware ZeRO-3 decision
        from smelt_ds.zero3_tuning import write_zero3_tuning

        write_zero3_tuning(out_dir, cfg, world, ds_config)
    precision = resolve_precision(cfg)

    budget = compute_budget(cfg, cfg.train.seq_len)
    accum = engine.gradient_accumulation_steps()
    tokens_per_step = cfg.train.micro_batch_size * cfg.train.seq_len * accum * world
    step, tokens_seen = 0, 0
    if resume != "none":
        state = ckpt.load(engine, out_dir, resume, built.layout)
        if state is not None:
            step, tokens_seen = state["step"], state["tokens_seen"]
            data.train.load_state_dict(state["loader"])
            ckpt.restore_rng(state["rng"])
            resync_lr(built.scheduler)
    result = RunResult(out_dir, step, tokens_seen, [], [], {}, [])
    if step >= cfg.train.max_steps:  # a resume of a finished run: nothing to train, nothing rewritten
        if rank == 0:
            print(f"run {out_dir} already finished: its checkpoint is at step {step}, train.max_steps is "
                  f"{cfg.train.max_steps}; nothing to train (raise train.max_steps to continue it)", file=sys.stderr)
        return result
    if rank == 0:
        dump_config(cfg, out_dir / "config.yaml")
        (out_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
    writer = MetricsWriter(out_dir, rank == 0, step)
    result_start = step
    micro = MicroStats()
    progress = _progress(rank, step, cfg.train.max_steps)
    t_last, tok_last = time.perf_counter(), tokens_seen
    with _Terminator() as term:
        while step < cfg.train.max_steps:
            ids: list[int] = []
            lr = step_lr(engine)  # the LR this optimizer step uses (the scheduler moves on in engine.step)
            for m in range(accum):
                batch = data.train.next_batch()
                ids.extend(int(i) for i in batch.sample_ids)
                out = engine(batch.input_ids, labels=batch.labels)
                engine.backward(out.loss)
                if m == accum - 1:
                    grad_norm = _grad_norm_before_step(engine, cfg)
                engine.step()
                micro.add(out)
            step += 1
            tokens_seen += tokens_per_step
            _after_step(model, cfg)
            means = micro.means()
            result.losses.append(means["loss"])
            result.lrs.append(lr)
            result.sample_ids.append(ids)
            if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
                now = time.perf_counter()
                tps = (tokens_seen - tok_last) / max(now - t_last, 1e-9)
                t_last, tok_last = now, tokens_seen
                row = {**means, "lr": lr, "grad_norm": _grad_norm(engine, grad_norm), "tokens": tokens_seen,
                       "tokens_per_s": tps, "tflops_per_device": budget.train_flops_per_token * tps / world / 1e12,
                       "memory_bytes": memory_bytes(), **routing_metrics(model)}
                peak = device_peak_tflops()
                if peak and precision == "bf16":
                    row["mfu"] = row["tflops_per_device"] / peak
                writer.write(step, row)
            progress.update(1)
            progress.set_postfix(loss=f"{means['loss']:.3f}")
            if step % cfg.train.eval_every == 0 or step == cfg.train.max_steps:
                result.val = evaluate(engine, data, cfg)
                writer.write(step, {f"val/{k}": v for k, v in result.val.items()})
            signalled = _sync_flag(term.requested)
            stop = signalled or (
                cfg.train.exit_after_steps is not None and step - result_start >= cfg.train.exit_after_steps)
            if step % cfg.train.save_every == 0 or step == cfg.train.max_steps or stop:
                ckpt.save(engine, out_dir, step, tokens_seen, data.train.state_dict(), cfg.train.keep_last,
                          built.layout)
            if stop:
                result.stopped_early = step < cfg.train.max_steps
                if result.stopped_early:
                    result.stop_reason = "signal" if signalled else "exit_after_steps"
                    if rank == 0:
                        why = ("stop signal (SIGTERM/SIGINT)" if result.stop_reason == "signal"
                               else f"train.exit_after_steps ({cfg.train.exit_after_steps})")
                        print(f"\nstopped at step {step} of {cfg.train.max_steps} by {why}; checkpoint "
                              f"step{step:08d} saved in {out_dir}: continue with --resume auto", file=sys.stderr)
                break
    progress.close()
    writer.close()
    result.step, result.tokens_seen = step, tokens_seen
    # a resume of a finished run trains nothing: keep its summary rather than overwrite it empty
    if rank == 0 and not result.stopped_early and step > result_start:
        _write_summary(out_dir, cfg, result, budget, data)
    return result


def resync_lr(scheduler) -> None:
    """Set every group's LR to the schedule's value at the restored step.

    A checkpoint restores the optimizer's per-group LR as the *old* schedule computed it for the
    next step; a resume that changed ``train.max_steps`` (allowed) changes the schedule, so the
    first resumed step would otherwise run at the old schedule's LR. ``LambdaLR``: ``lr = base_lr
    * lambda(last_epoch)``."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:
        return
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)


def step_lr(engine) -> float:
    """The learning rate the next optimizer step applies to unscaled groups (``lr_scale`` 1;
    looped groups use ``loop.shared_lr_scale`` times it), read from the optimizer before
    ``engine.step()`` advances the schedule."""
    groups = engine.optimizer.param_groups
    return float(next((g["lr"] for g in groups if g.get("lr_scale", 1.0) == 1.0), groups[0]["lr"]))


def _after_step(model, cfg: RunConfig) -> None:
    """Aux-loss-free bias update (DeepSeek-V3), outside autograd, after each optimizer step."""
    if not cfg.moe.aux_loss_free_bias:
        return
    from smelt_ds.model.moe import TopKRouter

    import torch.distributed as dist

    for m in model.modules():
        if isinstance(m, TopKRouter):
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(m.tokens_per_expert)
            m.update_bias(cfg.moe.bias_update_rate)


def _grad_norm_before_step(engine, cfg: RunConfig) -> float | None:
    """True global gradient norm before clipping (expert-parallel shards summed once, see
    :mod:`smelt_ds.grad_norm`), after the accumulation boundary's backward; at ZeRO-0 with an EP
    backend this also clips the gradients to ``train.grad_clip`` (DeepSpeed's own ZeRO-0 clipping
    is off there: its norm is wrong with expert parameters). None under optimizer offload."""
    from smelt_ds.grad_norm import clip_before_step

    return clip_before_step(engine, cfg.train.grad_clip)


def _grad_norm(engine, norm: float | None) -> float:
    """The norm to log: :func:`_grad_norm_before_step`'s, else DeepSpeed's (raises RuntimeError
    when DeepSpeed clipped with a different norm, see :func:`smelt_ds.grad_norm.logged_grad_norm`)."""
    from smelt_ds.grad_norm import logged_grad_norm

    return logged_grad_norm(engine, norm)


def _sync_flag(flag: bool) -> bool:
    """True on every rank when any rank got a stop signal."""
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class _NoProgress:
    def update(self, n): ...

    def set_postfix(self, **kw): ...

    def close(self): ...


def _progress(rank: int, start: int, total: int):
    if rank != 0:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)


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


def _write_summary(out_dir: Path, cfg: RunConfig, result: RunResult, budget, data) -> None:
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


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 trained to ``train.max_steps`` (or stopped by ``train.exit_after_steps``,
    or already finished), 2 bad configuration, 143 stopped by SIGTERM/SIGINT after saving a
    checkpoint (128 + SIGTERM, so ``train && next`` does not go on), 130 Ctrl-C before training
    started (nothing saved), 1 a checkpoint could not be written (e.g. a full disk; the previous
    complete checkpoint stays usable)."""
    args = parse_args(argv)
    return run_and_report(args, "smelt_ds.train")


def run_and_report(args: argparse.Namespace, prog: str) -> int:
    """Load ``args.recipe`` with ``args.set``, train, and turn the outcome into :func:`main`'s
    exit status, printing one ``PROG: error: ...`` line for a bad configuration or a failed save."""
    try:
        cfg = load_config(args.recipe, args.set)
        result = train(cfg, resume=args.resume, run_dir=args.run_dir)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except CheckpointWriteError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted before training started; nothing was saved", file=sys.stderr)
        return 130
    return exit_status(result)


def exit_status(result: RunResult) -> int:
    """143 (128 + SIGTERM) for a run stopped by a signal, else 0 (see :func:`main`)."""
    return 128 + signal.SIGTERM if result.stop_reason == "signal" else 0


if __name__ == "__main__":
    sys.exit(main())
