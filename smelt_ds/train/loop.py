"""The training loop. Runs under the ``deepspeed`` launcher or as one plain process.

    deepspeed [--num_gpus N | --hostfile H] --module smelt_ds.train RECIPE [--set k=v ...]
    smelt-ds train RECIPE [--set k=v ...] [--nproc N] [--resume auto]

The run directory (``train.run_dir``) receives the resolved recipe (``config.yaml``), the final
DeepSpeed config (``ds_config.json``), TensorBoard events (``tb/``), ``metrics.jsonl``,
checkpoints (``checkpoints/<tag>/``), ``zero3_tuning.json`` (ZeRO-3 runs: the loop-aware
prefetch/persistence values chosen from the visit plan), ``trackers/`` (the experiment trackers'
files and run ids, :mod:`smelt_ds.train.trackers`), ``profile/`` (traces of the ``profile``
window, :mod:`smelt_ds.train.profiler`) and ``summary.json`` / ``summary.txt`` at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from smelt_ds.config.loading import dump_config, load_config
from smelt_ds.config.run import RunConfig
from smelt_ds.cost.budget import compute_budget
from smelt_ds.errors import ConfigError
from smelt_ds.model.router import TopKRouter
from smelt_ds.parallel import control
from smelt_ds.parallel.build_lock import check_build_lock
from smelt_ds.parallel.device import device_of, to_device
from smelt_ds.parallel.distributed import find_free_port, init_distributed, on_rank0, set_rank_device, world_env
from smelt_ds.parallel.extension_cache import use_host_extension_dir
from smelt_ds.parallel.grad_norm import clip_before_step, logged_grad_norm
from smelt_ds.parallel.hardware import training_precision
from smelt_ds.parallel.skip import skipping_update
from smelt_ds.parallel.threads import ThreadChoice, apply_threads, thread_choice
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.runs.checkpoint import CheckpointWriteError
from smelt_ds.runs.provenance import init_from_tokenizer, record_run_tokenizer
from smelt_ds.runs.reshard import ResumePlan, engine_counters, load_resharded, plan_resume
from smelt_ds.runs.zero3_record import write_zero3_tuning
from smelt_ds.train.build import Built, build
from smelt_ds.train.console import Console, banner, step_line, val_line
from smelt_ds.train.data import build_data
from smelt_ds.train.guards import check_run_dir, lock_run_dir, remove_refused_new_run
from smelt_ds.train.in_loop_harness import check_harness_tasks, harness_due, run_harness_eval
from smelt_ds.train.metrics import (
    IntervalMeans,
    MetricsWriter,
    MicroStats,
    RunResult,
    device_peak_tflops,
    memory_bytes,
    routing_metrics,
    write_summary,
)
from smelt_ds.train.objective import total_loss
from smelt_ds.train.profiler import StepProfiler, check_profile
from smelt_ds.train.step_guard import SKIP_EXIT, StepGuardState, Verdict, resume_advice
from smelt_ds.train.stop import StopSources, agree
from smelt_ds.train.trackers import check_trackers, start_trackers
from smelt_ds.train.validation import evaluate
from smelt_ds.train.watchdog import (
    PEER_EXIT,
    CollectiveFailure,
    HangWatchdog,
    describe_peers,
    enable_flight_recorder,
    gather_peers,
    peer_fault,
    report_own_error,
    set_collective_timeout,
)

__all__ = ["main", "train", "build", "Built", "parse_args", "RunResult", "evaluate"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="smelt_ds.train", description="Train a SMELT or Baseline recipe.")
    add_train_arguments(p)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe, e.g. recipes/tiny/smelt.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field (YAML value), e.g. --set train.max_steps=200")
    p.add_argument("--resume", default="none",
                   help="'auto' continues from the latest complete checkpoint of the run directory, "
                        "'none' starts fresh, or a checkpoint directory")
    p.add_argument("--run-dir", default=None, help="override train.run_dir")


# ---------------------------------------------------------------------------------------------
# distributed setup
# ---------------------------------------------------------------------------------------------


#: the directory whose sitecustomize.py the launcher's processes import first (smelt_ds.import_hooks in
#: DeepSpeed's runner.py and launch.py, which do not import smelt_ds themselves)
LAUNCHER_SITE = Path(__file__).resolve().parent / "launcher_site"


def launcher_command(args: argparse.Namespace) -> list[str]:
    """The deepspeed launcher command line for ``--nproc N``: ``env PYTHONPATH=<launcher site>:...
    python -m deepspeed.launcher.runner ...`` (:data:`LAUNCHER_SITE`: the launcher's own processes
    skip MLflow as smelt-ds processes do; the ranks inherit the path, harmlessly)."""
    path = os.pathsep.join([str(LAUNCHER_SITE), *filter(None, [os.environ.get("PYTHONPATH")])])
    # the launcher of *this* interpreter (a bare `deepspeed` on PATH may belong to another env)
    cmd = ["env", f"PYTHONPATH={path}", sys.executable, "-m", "deepspeed.launcher.runner",
           "--num_gpus", str(args.nproc), "--master_port", str(find_free_port()),
           "--module", "smelt_ds.train", args.recipe, "--resume", args.resume]
    for s in args.set:
        cmd += ["--set", s]
    if args.run_dir:
        cmd += ["--run-dir", args.run_dir]
    return cmd


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------


def train(cfg: RunConfig, resume: str = "none", run_dir: str | None = None) -> RunResult:
    """Train ``cfg`` and return a :class:`RunResult`. Initialises torch.distributed if needed.

    First sets this rank's CPU threads (:mod:`smelt_ds.parallel.threads`: the user's
    ``OMP_NUM_THREADS``, else the cores split over the local ranks; one with
    ``train.deterministic``, which also turns on ``torch.use_deterministic_algorithms``); both are
    restored when training returns. Rank 0 holds the run directory's exclusive lock for the whole
    run (one writer per run). Raises ConfigError for bad configuration (a bad ``OMP_NUM_THREADS``
    included), incompatible data, an unusable checkpoint, or a run directory another training is
    using.
    """
    import torch.distributed as dist

    threads = thread_choice(cfg.train.deterministic)
    deterministic_before = (torch.are_deterministic_algorithms_enabled(),
                            torch.is_deterministic_algorithms_warn_only_enabled())
    threads_before = apply_threads(threads)
    try:
        if cfg.train.deterministic:
            _deterministic_on()
        use_host_extension_dir()  # DeepSpeed's JIT ops: one cache per host and CPU kind
        if not dist.is_initialized():
            if world_env()["RANK"] == "0":
                _print_lines(_deepspeed_op_notices(("ShareMemCommBuilder",)))
            enable_flight_recorder()  # before the process groups exist: they read it when made
            init_distributed(timeout_s=cfg.train.watchdog.init_timeout_s)
        else:  # a group made elsewhere (a test, a notebook): this rank's device all the same
            set_rank_device()
        return _train(cfg, resume, run_dir, threads)
    finally:
        torch.set_num_threads(threads_before)
        torch.use_deterministic_algorithms(deterministic_before[0], warn_only=deterministic_before[1])


def _deterministic_on() -> None:
    """``train.deterministic``: deterministic kernels (an op without one raises), and the cuBLAS
    workspace setting CUDA needs for them (``CUBLAS_WORKSPACE_CONFIG``, unless set)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def _print_lines(lines: list[str]) -> None:
    for line in lines:
        print(line, file=sys.stderr, flush=True)


#: DeepSpeed C++ ops a run may compile on first use: builder class -> what it is for
_DS_OPS = {"ShareMemCommBuilder": "DeepSpeed's CPU shared-memory collectives, built by deepspeed.init_distributed",
           "CPUAdamBuilder": "DeepSpeed's CPU Adam for deepspeed.offload_optimizer"}


def _deepspeed_op_notices(builders: tuple[str, ...]) -> list[str]:
    """One line per DeepSpeed op of ``builders`` (:data:`_DS_OPS` keys) that DeepSpeed compiles
    on its first use on this machine (a C++ JIT build with ninja: about 35 s of compiler time, a
    minute or more on a small shared machine) or reuses from torch's extension cache
    (``$TORCH_EXTENSIONS_DIR``: the user's, else this host's own directory that :func:`train` sets,
    :func:`smelt_ds.parallel.extension_cache.use_host_extension_dir`; ``<python>_<device>/<op>`` under it).
    No line for an op the accelerator does not use, or one the DeepSpeed install ships prebuilt.
    Raises ConfigError naming the file to remove when an interrupted build left the op's build
    lock behind; a lock another host may hold is a line of its own
    (:func:`smelt_ds.parallel.build_lock.check_build_lock`)."""
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return []
    lines = []
    for cls in builders:
        b = get_accelerator().create_op_builder(cls)
        if b is None or installed_ops.get(b.name, False) or not deepspeed.ops.__compatible_ops__.get(b.NAME, False):
            continue
        where = Path(_get_build_directory(b.name, verbose=False))
        waiting = check_build_lock(where, b.name)  # a stale lock: torch would wait forever
        if waiting:  # a lock another host's build may hold
            lines.append(waiting)
        if (where / f"{b.name}.so").is_file():
            lines.append(f"deepspeed op {b.name} ({_DS_OPS[cls]}): reusing the build cached in {where}")
        else:
            lines.append(f"deepspeed op {b.name} ({_DS_OPS[cls]}): compiling it now, once per machine (a C++ "
                         f"JIT build, a minute or more on a small CPU); cached afterwards in {where}")
    return lines


def _train(cfg: RunConfig, resume: str, run_dir: str | None, threads: ThreadChoice) -> RunResult:
    """:func:`train` after the threads are set and torch.distributed is initialised."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out_dir = Path(run_dir or cfg.train.run_dir.format(name=cfg.name))
    if run_dir is not None:  # config.yaml says where the run lives, so the recipe resumes it as it is
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"run_dir": str(run_dir)})})
    cfg = init_from_tokenizer(cfg)  # a run started from an export trains on with its tokenizer
    check_profile(cfg.profile, cfg.train.max_steps, world)
    # a missing tracker package or an unreachable server: refused before the run directory (or, with
    # tracking.on_unreachable: fallback, the trackers to fall back for)
    unreachable = on_rank0(rank, lambda: check_trackers(cfg)) or []
    lock, created = lock_run_dir(out_dir, rank)
    try:
        check_run_dir(out_dir, cfg, resume, world)
        control.barrier()
        return _fit(cfg, resume, out_dir, rank, world, threads, unreachable)
    except ConfigError:
        if rank == 0 and created and lock is not None:  # a refused new run leaves no directory behind
            lock.release()
            lock = None
            remove_refused_new_run(out_dir)
        raise
    finally:
        if lock is not None:
            lock.release()


def _fit(cfg: RunConfig, resume: str, out_dir: Path, rank: int, world: int, threads: ThreadChoice,
         unreachable: list[str]) -> RunResult:
    """The body of :func:`train`, in a locked, checked run directory: build, restore, then one
    optimizer step at a time with logging, validation and checkpoints until ``train.max_steps``
    or a stop (signal, ``train.exit_after_steps``)."""
    torch.manual_seed(cfg.train.seed)
    if cfg.eval.harness_tasks:  # unknown task names fail now, not at the first in-loop evaluation
        on_rank0(rank, lambda: check_harness_tasks(cfg))
    # a resume keeps the run's global batch; at another layout it converts the checkpoint (runs/reshard.py)
    asked = cfg.train.gradient_accumulation_steps
    cfg, plan = plan_resume(cfg, out_dir, resume, world)
    accum = cfg.train.gradient_accumulation_steps or 1
    if rank == 0 and plan is None and asked not in (None, accum):  # a layout change prints its own line
        print(f"train.gradient_accumulation_steps: the recipe's {asked} -> {accum} on {world} rank(s), which keeps the "
              f"run's global batch of {cfg.train.micro_batch_size * accum * world} samples (a resume keeps the run's "
              "batch; to train with another, start a new run from the weights: `smelt-ds export`, then "
              "train.init_from)", file=sys.stderr)
    data = build_data(cfg, rank, world)
    if rank == 0 and cfg.deepspeed.offload_optimizer != "none":
        _print_lines(_deepspeed_op_notices(("CPUAdamBuilder",)))
    built = build(cfg, world)  # before anything is written: a recipe the engine refuses leaves no trace
    # DeepSpeed's groups (data-parallel, expert, expert-data) were made with the backend's default
    # timeout: every group gets the start-up timeout now, the steady one after the first steps
    set_collective_timeout(cfg.train.watchdog.init_timeout_s)
    on_rank0(rank, lambda: record_run_tokenizer(out_dir, data.prepared, resuming=resume != "none"))
    if rank == 0 and cfg.train.compile != "none":
        print(f"train.compile: {cfg.train.compile} (backend {cfg.train.compile_backend}): the first step compiles, and "
              "the first validation compiles its no-grad graphs (tens of seconds on a CPU; inductor caches kernels "
              "under $TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_<user>)", file=sys.stderr)
    if rank == 0 and cfg.deepspeed.zero_stage == 3:  # loop-aware ZeRO-3
        write_zero3_tuning(out_dir, cfg, world, built.ds_config)
    guard = StepGuardState(cfg.train.step_guard)
    step, tokens_seen, plan = _restore(built, data, out_dir, resume, guard, cfg, plan)
    if step >= cfg.train.max_steps:  # a resume of a finished run: nothing to train, nothing rewritten
        if rank == 0:
            print(f"run {out_dir} already finished: its checkpoint is at step {step}, train.max_steps is "
                  f"{cfg.train.max_steps}; nothing to train (raise train.max_steps to continue it)", file=sys.stderr)
        return RunResult(out_dir, step, tokens_seen, [], [], {}, [])
    if rank == 0:
        dump_config(cfg, out_dir / "config.yaml")
        (out_dir / "ds_config.json").write_text(json.dumps(built.ds_config, indent=2))
    fit = _Fit(cfg, out_dir, rank, world, data, built, step, tokens_seen, unreachable)
    fit.guard = guard
    if plan is not None:  # the resume at another layout or micro-batch size, in the run's record
        fit.writer.write(step, plan.record())
    fit.result.threads = {"torch_threads": torch.get_num_threads(), "reason": threads.reason}
    fit.console.line(banner(cfg, run_dir=out_dir, world=world, accum=fit.accum, budget=fit.budget,
                            precision=fit.precision, device=_device(), threads=threads, start_step=step))
    fit.console.start_bar()
    peers = gather_peers()
    fit.t_last = time.perf_counter()  # the first window starts at step 1
    with StopSources(out_dir, check_file=rank == 0) as stops, \
            HangWatchdog(cfg.train.watchdog, out_dir, rank, peers) as watchdog:
        fit.stops = stops
        try:
            _steps(fit, stops, watchdog)
        except Exception as e:
            fit.writer.flush()  # a failing rank may end without finalization: TensorBoard's buffer first
            # exit 75 only for a collective failure a peer caused: the error's type and the peers' state
            cause = peer_fault(e, peers, rank)
            if cause is None:  # the job's own error (whatever its text says): a requeue would meet it again
                report_own_error(rank, e)  # so that a peer whose collective now fails exits 1 too, not 75
                raise
            why = (f"a collective failed at step {fit.step + 1} ({type(e).__name__}: "
                   f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else 'no message'})")
            watchdog.dump_on_failure(why)
            raise CollectiveFailure(
                f"rank {rank}: {why}: a peer is lost: {cause}. Peers: {describe_peers(peers, rank)}. Every thread's "
                f"stack is in {watchdog.dir}. The newest complete checkpoint is kept: --resume auto continues from "
                f"it; exit status {PEER_EXIT} (retryable: a scheduler may requeue; docs/faults.md)") from e
    fit.profiler.close()
    fit.console.close()
    fit.writer.close()
    result = fit.result
    result.step, result.tokens_seen = fit.step, fit.tokens_seen
    # a resume of a finished run trains nothing: keep its summary rather than overwrite it empty
    if rank == 0 and not result.stopped_early and fit.step > fit.start:
        write_summary(out_dir, cfg, result, fit.budget, data)
    return result


def _steps(fit: _Fit, stops: StopSources, watchdog: HangWatchdog) -> None:
    """Train until ``train.max_steps`` or a stop: each optimizer step under the hang watchdog
    (:class:`~smelt_ds.train.watchdog.HangWatchdog`: the step's timeout, then the startup timeout
    for validation, harness evaluation and the save), the collective timeout switched to its
    steady value once the first steps are done, and one all-reduce per step on whether to stop
    (:func:`~smelt_ds.train.stop.agree`)."""
    cfg, built, data = fit.cfg, fit.built, fit.data
    slow = cfg.train.watchdog.startup_timeout_s
    while fit.step < cfg.train.max_steps:
        watchdog.arm(watchdog.step_timeout(), f"step {fit.step + 1}", watchdog.basis)
        t_step = time.perf_counter()
        fit.profiler.before_step(fit.step + 1)
        lr, ids, grad_norm, means = _train_step(fit)
        if fit.verdict.skip is None:
            fit.result.losses.append(means["loss"])
            fit.result.lrs.append(lr)
        fit.result.sample_ids.append(ids)
        _log_step(fit, lr, grad_norm, means)
        if watchdog.step_done(time.perf_counter() - t_step):
            set_collective_timeout(cfg.train.watchdog.collective_timeout_s)
        t_eval = time.perf_counter()  # evaluations are left out of the logged throughput
        if fit.step % cfg.train.eval_every == 0 or fit.step == cfg.train.max_steps:
            watchdog.arm(slow, f"validation at step {fit.step}")
            fit.result.val = evaluate(built.engine, data, cfg)
            fit.writer.write(fit.step, {f"val/{k}": v for k, v in fit.result.val.items()})
            fit.console.line(val_line(fit.step, fit.result.val))
        if harness_due(cfg, fit.step):  # lm-eval tasks on rank 0's gathered copy of the model
            watchdog.arm(slow, f"harness evaluation at step {fit.step}")
            run_harness_eval(built.engine, cfg, data.prepared, fit.step, fit.tokens_seen, fit.writer)
        fit.eval_s += time.perf_counter() - t_eval
        watchdog.arm(slow, f"the end of step {fit.step} (checkpoint save)")
        stop = _save_or_stop(fit, stops, fit.stop_reason)
        fit.profiler.after_step(fit.step)  # the profiled step spans the whole iteration
        if stop:
            break
    watchdog.disarm()


def _restore(built: Built, data, out_dir: Path, resume: str, guard: StepGuardState, cfg: RunConfig,
             plan: ResumePlan | None) -> tuple[int, int, ResumePlan | None]:
    """``(step, tokens_seen, plan)`` of the checkpoint ``--resume`` names, with the engine, the loader
    position, the RNG, the LR schedule and the step guard's state restored; ``(0, 0, None)`` for a
    new run. A checkpoint of another layout (``plan`` with ``changes``, :func:`smelt_ds.runs.reshard.plan_resume`;
    recomputed for the checkpoint :func:`smelt_ds.runs.checkpoint.choose` settles on) is loaded
    from its layout-free state (:func:`smelt_ds.runs.reshard.load_resharded`), any other (also one
    resumed with another micro-batch size) through DeepSpeed. The LR schedule keeps the recipe's
    base LR (``train.lr``, which a resume may change: :func:`resync_lr`)."""
    import torch.distributed as dist

    if resume == "none":
        return 0, 0, None
    path = ckpt.choose(out_dir, resume)
    if path is None:
        return 0, 0, None
    if plan is None or plan.checkpoint != path:  # a damaged newer one was set aside: the older one's layout
        _, plan = plan_resume(cfg, out_dir, str(path), dist.get_world_size())
    if plan is not None and dist.get_rank() == 0:
        print(plan.console(), file=sys.stderr, flush=True)
    base_lrs = list(getattr(built.scheduler, "base_lrs", []))  # the recipe's: DeepSpeed's load restores the run's
    if plan is None or not plan.changes:
        state = ckpt.load_from(built.engine, path, built.layout)
    else:
        state = load_resharded(built, path, cfg.moe_runtime.backend)
    data.train.load_state_dict(state["loader"])
    ckpt.restore_rng(state["rng"])
    resync_lr(built.scheduler, base_lrs)
    guard.load_state_dict(state.get("step_guard", {}))  # checkpoints before the step guard have none
    return state["step"], state["tokens_seen"], plan


class _Fit:
    """What the steps of one fit share: the run, the engine, counters (optimizer steps, tokens),
    the loggers (files, TensorBoard and the experiment trackers, rank 0) and the profiler."""

    def __init__(self, cfg: RunConfig, out_dir: Path, rank: int, world: int, data, built: Built, step: int,
                 tokens_seen: int, unreachable: list[str]):
        self.cfg, self.out_dir, self.rank, self.world, self.data, self.built = cfg, out_dir, rank, world, data, built
        self.step, self.tokens_seen, self.start = step, tokens_seen, step
        self.accum = built.engine.gradient_accumulation_steps()
        self.tokens_per_step = cfg.train.micro_batch_size * cfg.train.seq_len * self.accum * world
        self.budget = compute_budget(cfg, cfg.train.seq_len)
        self.precision = training_precision(cfg)
        self.result = RunResult(out_dir, step, tokens_seen, [], [], {}, [])
        trackers = on_rank0(rank, lambda: start_trackers(cfg, out_dir, step, self.budget.as_dict(), unreachable))
        self.writer = MetricsWriter(out_dir, rank == 0, step, trackers or ())
        self.profiler = StepProfiler(cfg.profile, out_dir, rank, step)
        self.micro = MicroStats()
        self.interval = IntervalMeans()
        self.console = Console(rank == 0, step, cfg.train.max_steps)
        self.t_last, self.tok_last = time.perf_counter(), tokens_seen
        self.eval_s = 0.0  # seconds of validation / harness evaluation since the last log row
        self.guard = StepGuardState(cfg.train.step_guard)
        self.verdict = Verdict(math.nan, False, None)  # the last step's
        self.skipped_since_log = 0
        self.device = device_of(built.engine)  # where every batch goes (smelt_ds.parallel.device)
        self.stops: StopSources | None = None  # polled at each step's accumulation boundary
        self.stop_reason: str | None = None  # what the ranks agreed on at the last step


def _train_step(fit: _Fit) -> tuple[float, list[int], float | None, dict[str, float]]:
    """One optimizer step over ``accum`` micro-batches. Returns ``(lr, sample ids, the true global
    gradient norm before clipping, the step's means)``.

    Before the accumulation boundary's ``engine.step()`` the ranks agree on whether to keep the
    update (:meth:`~smelt_ds.train.step_guard.StepGuardState.decide`: a non-finite loss or
    gradient norm on any rank, or a loss spike, skips it on every rank through DeepSpeed's overflow
    path; the verdict is ``fit.verdict``)."""
    engine, cfg = fit.built.engine, fit.cfg
    ids: list[int] = []
    grad_norm = None
    lr = step_lr(engine)  # the LR this optimizer step uses (the scheduler moves on in engine.step)
    means: dict[str, float] = {}
    for m in range(fit.accum):
        batch = fit.data.train.next_batch()
        ids.extend(batch.sample_ids.tolist())  # host values: they stay on the host
        input_ids, labels = to_device(fit.device, batch.input_ids, batch.labels)
        out = engine(input_ids, labels=labels)
        loss = total_loss(out, cfg.train)  # lm + aux_coef * aux + z_coef * z
        engine.backward(loss)
        fit.micro.add(out, loss)  # on the device: read once per step, below
        if m < fit.accum - 1:
            engine.step()
            continue
        grad_norm = _grad_norm_before_step(engine, cfg)
        # the step's one control all-reduce: losses for the guard and the logs, and the stop poll
        fit.stop_reason, totals = agree(fit.stops.poll() if fit.stops is not None else None, fit.micro.local())
        fit.verdict = fit.guard.decide(totals[0], totals[1], totals[2], grad_norm)
        means = fit.micro.means(totals)
        if fit.verdict.skip is None:
            engine.step()
        else:
            with skipping_update(engine):
                engine.step()
    fit.step += 1
    fit.tokens_seen += fit.tokens_per_step
    if fit.verdict.skip is None:
        _after_step(fit.built.model, cfg)
    else:
        _report_skip(fit, ids)
    return lr, ids, grad_norm, means


def _report_skip(fit: _Fit, ids: list[int]) -> None:
    """A skipped step: the routers' load counts of the step are dropped (no bias update), and rank 0
    writes a ``metrics.jsonl`` row (``skipped``, ``skip_reason``, ``skipped_total`` and every rank's
    ``sample_ids``) and a console line naming the step, the reason and the samples."""
    for m in fit.built.model.modules():
        if isinstance(m, TopKRouter):
            m.tokens_per_expert.zero_()
    every: list[Any] = control.gather_objects(ids)
    fit.skipped_since_log += 1
    samples = [i for rank_ids in every for i in rank_ids]
    fit.writer.write(fit.step, {"skipped": 1, "skip_reason": fit.verdict.skip, "skipped_total": fit.guard.skipped,
                                "consecutive_skips": fit.guard.consecutive, "sample_ids": samples})
    shown = ", ".join(map(str, samples[:16])) + (f", ... ({len(samples)} in all)" if len(samples) > 16 else "")
    fit.console.line(f"step {fit.step}: update skipped on every rank: {fit.verdict.skip} (mean loss "
                     f"{fit.verdict.mean_loss:.4f}); samples {shown}; {fit.guard.consecutive} in a row of at most "
                     f"{fit.cfg.train.step_guard.max_consecutive_skips} (train.step_guard), {fit.guard.skipped} in all")


def _log_step(fit: _Fit, lr: float, grad_norm: float | None, means: dict[str, float]) -> None:
    """Every ``train.log_every`` steps (and the last): a ``metrics.jsonl`` / TensorBoard row and a
    console line with the losses averaged over the steps since the previous row
    (:class:`~smelt_ds.train.metrics.IntervalMeans`; ``loss_last_step`` the last step's), this
    step's LR and gradient norm, throughput (tokens/s), TFLOP/s per device, memory and routing;
    the progress bar (on a terminal) every step. ``lr`` and ``grad_norm`` are the last step's;
    ``tokens_per_s`` is the interval's tokens over its wall-clock seconds less the validation and
    harness evaluations run in it (checkpoint saves count)."""
    cfg, step = fit.cfg, fit.step
    if fit.verdict.skip is None:  # a skipped step's loss is not the model's: left out of the means
        fit.interval.add(means)
    if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
        now = time.perf_counter()
        seconds = max(now - fit.t_last - fit.eval_s, 1e-9)
        tps = (fit.tokens_seen - fit.tok_last) / seconds
        fit.result.windows.append((fit.tokens_seen - fit.tok_last, seconds))
        fit.t_last, fit.tok_last, fit.eval_s = now, fit.tokens_seen, 0.0
        losses = fit.interval.pop() if fit.interval.n else {"loss_steps": 0}
        norm = grad_norm if fit.verdict.skip is not None else _grad_norm(fit.built.engine, grad_norm)
        row: dict[str, Any] = {**losses, "lr": lr, "grad_norm": norm, "skipped_steps": fit.skipped_since_log,
               "tokens": fit.tokens_seen,
               "tokens_per_s": tps, "tflops_per_device": fit.budget.train_flops_per_token * tps / fit.world / 1e12,
               "memory_bytes": memory_bytes(), **routing_metrics(fit.built.model)}
        peak = device_peak_tflops()
        if peak and fit.precision == "bf16":
            row["mfu"] = row["tflops_per_device"] / peak
        fit.skipped_since_log = 0
        fit.writer.write(step, row)
        eta = (cfg.train.max_steps - step) * seconds / max(1, row["loss_steps"] + row["skipped_steps"])
        fit.console.line(step_line(step, cfg.train.max_steps, row, cuda=torch.cuda.is_available(), eta_s=eta))
    fit.console.advance(means["loss"])


def _save_or_stop(fit: _Fit, stops: StopSources, reason: str | None) -> bool:
    """Save a checkpoint every ``train.save_every`` steps, at the last step and before a stop.
    Returns True when training stops here: ``reason`` (what :func:`~smelt_ds.train.stop.agree`
    returned: a signal, the stop file or the launcher's death on any rank), ``train.exit_after_steps``,
    or ``train.step_guard.max_consecutive_skips`` skipped steps in a row (the saved state is the
    last good one: a skipped step changes no weight)."""
    cfg, step, result = fit.cfg, fit.step, fit.result
    if reason is None and fit.guard.exhausted():
        reason = "skips"
    if reason is None and cfg.train.exit_after_steps is not None and step - fit.start >= cfg.train.exit_after_steps:
        reason = "exit_after_steps"
    stop = reason is not None
    if step % cfg.train.save_every == 0 or step == cfg.train.max_steps or stop:
        ckpt.save(fit.built.engine, fit.out_dir, step, fit.tokens_seen, fit.data.train.state_dict(),
                  cfg.train.keep_last, fit.built.layout, reference_weights=cfg.train.reference_weights,
                  final=stop or step == cfg.train.max_steps, optimizer_state=cfg.train.layout_free_state,
                  client_extra={"step_guard": fit.guard.state_dict(), "counters": engine_counters(fit.built)})
    if not stop:
        return False
    stops.consume(step)  # the saved checkpoint answers every stop file written before it
    result.stopped_early = step < cfg.train.max_steps or reason == "skips"
    if not result.stopped_early:
        return True
    result.stop_reason = reason
    if fit.rank == 0:
        if reason == "skips":
            why = (f"{fit.guard.consecutive} consecutive skipped steps (train.step_guard.max_consecutive_skips "
                   f"{cfg.train.step_guard.max_consecutive_skips}; the last: {fit.verdict.skip})")
            after = resume_advice(cfg.train)
        else:
            why = (f"train.exit_after_steps ({cfg.train.exit_after_steps})" if reason == "exit_after_steps"
                   else stops.describe(str(reason)))
            after = "continue with --resume auto"
        print(f"\nstopped at step {step} of {cfg.train.max_steps} by {why}; checkpoint step{step:08d} saved in "
              f"{fit.out_dir}: {after}", file=sys.stderr)
    return True


def resync_lr(scheduler, base_lrs: list[float] | None = None) -> None:
    """Set every group's LR to the schedule's value at the restored step.

    A checkpoint restores the optimizer's per-group LR as the *old* schedule computed it for the
    next step, and DeepSpeed's load restores the scheduler's ``base_lrs`` (the run's ``train.lr``);
    a resume that changed ``train.max_steps`` or ``train.lr`` (both allowed) changes the schedule,
    so the first resumed step would otherwise run at the old schedule's LR. ``base_lrs``: the
    recipe's, as the engine was built before the load (None: keep the scheduler's). ``LambdaLR``:
    ``lr = base_lr * lambda(last_epoch)``."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:
        return
    if base_lrs:
        scheduler.base_lrs = list(base_lrs)
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, lambdas, strict=True):
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

    import torch.distributed as dist

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    if routers and dist.is_initialized() and dist.get_world_size() > 1:
        # every router's counts in one all-reduce, on the model's device (data, not control)
        counts = [m.tokens_per_expert for m in routers]
        flat = torch.cat([c.reshape(-1) for c in counts])
        dist.all_reduce(flat)
        for c, summed in zip(counts, flat.split([c.numel() for c in counts]), strict=True):
            c.copy_(summed.view_as(c))
    for m in routers:
        m.update_bias(cfg.moe.bias_update_rate)


def _grad_norm_before_step(engine, cfg: RunConfig) -> float | None:
    """True global gradient norm before clipping (expert-parallel shards summed once, see
    :mod:`smelt_ds.parallel.grad_norm`), after the accumulation boundary's backward; at ZeRO-0 with an EP
    backend this also clips the gradients to ``train.grad_clip`` (DeepSpeed's own ZeRO-0 clipping
    is off there: its norm is wrong with expert parameters). None under optimizer offload."""

    return clip_before_step(engine, cfg.train.grad_clip)


def _grad_norm(engine, norm: float | None) -> float:
    """The norm to log: :func:`_grad_norm_before_step`'s, else DeepSpeed's (raises RuntimeError
    when DeepSpeed clipped with a different norm, see :func:`smelt_ds.parallel.grad_norm.logged_grad_norm`)."""

    return logged_grad_norm(engine, norm)


def _device() -> str:
    """``"cpu"`` or ``"cuda (<device name>)"`` for the banner."""
    return f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    """Exit status (docs/faults.md):

    * 0: trained to ``train.max_steps`` (or stopped by ``train.exit_after_steps``, or already finished);
    * 1: a checkpoint could not be written (e.g. a full disk; the previous complete checkpoint
      stays usable), or an unexpected error (its traceback, prefixed with the rank);
    * 2: bad configuration;
    * 3: stopped after ``train.step_guard.max_consecutive_skips`` skipped steps in a row, the last
      good state saved (:data:`~smelt_ds.train.step_guard.SKIP_EXIT`);
    * 75: a collective failed because a peer rank was lost (died, stopped, or its host's connection
      failed; :func:`~smelt_ds.train.watchdog.peer_fault`, :data:`~smelt_ds.train.watchdog.PEER_EXIT`;
      no new checkpoint); a failed collective with no peer lost exits 1;
    * 124: the hang watchdog fired, stacks in ``<run_dir>/hangs/`` (:data:`~smelt_ds.train.watchdog.HANG_EXIT`);
    * 130: Ctrl-C before training started (nothing saved);
    * 143: stopped by a signal, the stop file or the launcher's death, after saving a checkpoint
      (128 + SIGTERM, so ``train && next`` does not go on)."""
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
        if _rank() == 0:  # every rank raises the same error
            print(f"{prog}: error: {e}", file=sys.stderr)
        _destroy_process_group()  # every rank agreed on the failure through a collective: the group is sound
        return 1
    except CollectiveFailure as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return PEER_EXIT
    except KeyboardInterrupt:
        print(f"{prog}: interrupted before training started; nothing was saved", file=sys.stderr)
        return 130
    except Exception:  # noqa: BLE001 - named with its rank, so that a job's log says which rank failed
        print(f"{prog}: rank {_rank()}: unexpected error (the other ranks end when their next collective fails):\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
    _destroy_process_group()
    return exit_status(result)


def _destroy_process_group() -> None:
    """After a run that ended on every rank together (finished, stopped and saved, or a failed
    save every rank agreed on): tear the process groups down before the process exits, as
    torchtitan does and ``torch.distributed``'s documentation asks. Gloo's worker threads left to
    the interpreter's finalization can abort the process (``terminate called without an active
    exception``, exit 134 instead of the documented status; pytorch/pytorch#190489, #179291).
    Not after a failure: a group whose peer is gone may not tear down (the rank's entry point,
    :mod:`smelt_ds.train.__main__`, ends such a process without finalization)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
        control.reset()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


#: exit status by stop reason (:func:`main`); other reasons (exit_after_steps) and none: 0
_STOP_STATUS = {"signal": 128 + signal.SIGTERM, "stop_file": 128 + signal.SIGTERM, "launcher": 128 + signal.SIGTERM,
                "skips": SKIP_EXIT}


def exit_status(result: RunResult) -> int:
    """The exit status of a finished or stopped run (see :func:`main`): 143 (128 + SIGTERM) for a
    stop by a signal, the stop file or the launcher's death, 3 after too many skipped steps, else 0."""
    return _STOP_STATUS.get(result.stop_reason or "", 0)
