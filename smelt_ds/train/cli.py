"""``smelt-ds train`` (``smelt-ds export`` is :mod:`smelt_ds.interop.cli`'s)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from smelt_ds.config.loading import load_config
from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError
from smelt_ds.runs.provenance import init_from_tokenizer
from smelt_ds.runs.run_lock import RunLock
from smelt_ds.train.guards import check_optional_packages, check_run_dir
from smelt_ds.train.loop import add_train_arguments, launcher_command, run_and_report
from smelt_ds.train.profiler import check_profile
from smelt_ds.train.stop import clear_stop_file
from smelt_ds.train.trackers import check_trackers


def add_parser(sub: argparse._SubParsersAction) -> None:

    p = sub.add_parser("train", help="train a recipe (one process, or N local ranks via the deepspeed launcher)",
                       description="Train a SMELT or Baseline recipe. With --nproc N > 1 the deepspeed launcher "
                                   "starts N local ranks (gloo on CPU, NCCL on GPUs).")
    add_train_arguments(p)
    p.add_argument("--nproc", type=int, default=1, help="local ranks (default 1: this process)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    """``smelt-ds train``: one process, or ``--nproc N`` local ranks through the deepspeed
    launcher (:func:`run_launcher`), after :func:`check_before_launch`. Returns the exit status of
    :func:`smelt_ds.train.loop.main` (143: stopped by a signal after saving a checkpoint).

    Raises ConfigError for ``--nproc`` < 1 and, with ``--nproc`` > 1, for what
    :func:`check_before_launch` refuses (printed once, before any rank starts)."""
    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: the number of local ranks must be >= 1 (1: this process)")
    check_before_launch(args)  # one process too: refused before DeepSpeed starts
    if args.nproc > 1:
        cmd = launcher_command(args)
        print("launching: " + " ".join(cmd), file=sys.stderr)
        return run_launcher(cmd)
    return run_and_report(args, "smelt-ds train")


def check_before_launch(args: argparse.Namespace) -> RunConfig:
    """What every rank would refuse, checked once in the launching process: the recipe with its
    ``--set`` overrides (:func:`smelt_ds.config.loading.load_config`), optional packages
    (:func:`smelt_ds.train.guards.check_optional_packages`), the trackers' packages
    (:func:`smelt_ds.train.trackers.check_trackers`), the profiled window and ranks
    (:func:`smelt_ds.train.profiler.check_profile`), the run directory's lock (another
    training using it) and the run-directory guards for ``--resume`` with ``--nproc`` ranks
    (:func:`smelt_ds.train.guards.check_run_dir`, changing nothing). Then, holding the run's lock,
    it removes a stop file left by an earlier run (:func:`smelt_ds.train.stop.clear_stop_file`): a
    STOP written from then on, during start-up included, stops this run at its next step. Returns
    the config as the ranks will train it; raises ConfigError."""
    cfg = load_config(args.recipe, args.set)
    out_dir = Path(args.run_dir or cfg.train.run_dir.format(name=cfg.name))
    if args.run_dir is not None:  # as smelt_ds.train.loop.train resolves it
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"run_dir": str(args.run_dir)})})
    cfg = init_from_tokenizer(cfg)
    check_optional_packages(cfg)
    check_trackers(cfg)
    check_profile(cfg.profile, cfg.train.max_steps, args.nproc)
    if not out_dir.is_dir():
        check_run_dir(out_dir, cfg, args.resume, args.nproc, take_over=False)
        return cfg
    with RunLock(out_dir):  # another training there is named now, not once per rank later
        check_run_dir(out_dir, cfg, args.resume, args.nproc, take_over=False)
        clear_stop_file(out_dir, "smelt-ds train")  # no training runs there: a STOP there is an earlier run's
    return cfg


#: signals that stop a training: Ctrl-C, a scheduler's or `kill`'s SIGTERM, a closed terminal
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_launcher(cmd: list[str], **popen: Any) -> int:
    """Run the deepspeed launcher command ``cmd`` (:func:`smelt_ds.train.loop.launcher_command`)
    and wait for it; returns the exit status (see :func:`launcher_status`). ``popen``: further
    ``subprocess.Popen`` arguments (e.g. ``stdout`` and ``stderr`` to a log file).

    The launcher runs in its own session, so a Ctrl-C at the terminal (SIGINT to the foreground
    process group) reaches this process only: DeepSpeed 0.19.8's ``runner.py`` would die of it
    with a KeyboardInterrupt traceback, and its ``launch.py`` would SIGTERM the ranks and exit 1.
    Here SIGINT, SIGTERM (``kill``, a batch scheduler) and SIGHUP are caught while waiting and
    forwarded to the ranks (the children of ``launch.py``) as SIGTERM: each finishes its step,
    the ranks save a checkpoint together and exit 143, which ``launch.py`` and ``runner.py``
    pass on. ``launch.py`` SIGKILLs ranks that are still alive 30 seconds after the first one
    exited. A signal before the ranks started stops the launcher."""
    state: dict[str, Any] = {"proc": None, "signals": []}

    def forward(signum: int, frame: Any) -> None:
        if not state["signals"]:
            print(f"\nsmelt-ds train: {signal.Signals(signum).name}: asking the ranks to finish their step, save a "
                  "checkpoint and stop", file=sys.stderr, flush=True)
        state["signals"].append(signum)
        if state["proc"] is not None:
            _stop_ranks(state["proc"].pid)

    with _handling(STOP_SIGNALS, forward):
        state["proc"] = proc = subprocess.Popen(cmd, start_new_session=True, **popen)
        if state["signals"]:  # arrived while it started
            _stop_ranks(proc.pid)
        rc = proc.wait()
    return launcher_status(rc, state["signals"][0] if state["signals"] else None)


def launcher_status(rc: int, signum: int | None) -> int:
    """The exit status of ``smelt-ds train --nproc N`` from the launcher's ``rc`` (negative: killed
    by that signal) and the first stop signal received (None: none).

    Without a signal: the launcher's status, which is the first failing rank's
    (:func:`smelt_ds.train.loop.main`: 2 bad configuration, 1 a checkpoint write failed); a rank
    killed by signal N gives 128 + N, as a shell reports it (DeepSpeed's ``launch.py`` exits with
    the rank's negative return code -N, which the OS turns into 256 - N: 247 for SIGKILL). After a
    signal: 143 when the ranks saved a checkpoint and stopped, 0 when they had finished, 2 a bad
    configuration; otherwise (stopped before training started, or a rank failed) 128 + the signal,
    with a note that this stop saved no checkpoint."""
    status = 128 - rc if rc < 0 else rc
    if 256 - 64 < status < 256:  # launch.py's sys.exit(-N) for a rank killed by signal N (1..63)
        status = 128 + 256 - status
    if signum is None or rc in (0, 2, 128 + signal.SIGTERM):  # rc, not status: killed by SIGTERM saved nothing
        return status
    print(f"smelt-ds train: the ranks stopped without saving a checkpoint for this {signal.Signals(signum).name} "
          f"(launcher exit status {status}): stopped before training started (nothing to save) or a rank failed "
          "(see the messages above)", file=sys.stderr)
    return 128 + signum


def _stop_ranks(runner_pid: int) -> None:
    """SIGTERM to the ranks: the children of ``deepspeed.launcher.launch``, itself the child of
    ``deepspeed.launcher.runner`` (``runner_pid``); to the launchers, or the runner, before the
    ranks exist (``launch.py`` terminates what it started)."""
    import psutil

    try:
        runner = psutil.Process(runner_pid)
        launchers = runner.children()
        ranks = [p for launcher in launchers for p in launcher.children()]
    except psutil.Error:  # the launcher has exited meanwhile
        return
    for p in ranks or launchers or [runner]:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass


@contextlib.contextmanager
def _handling(signals: tuple[signal.Signals, ...], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` for ``signals`` inside the block (main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
