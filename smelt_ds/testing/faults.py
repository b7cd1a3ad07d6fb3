"""Faults injected into real training processes, for tests and benchmarks of the failure paths.

A test starts training (``python -m smelt_ds.cli train RECIPE --nproc 2``, ``deepspeed --module
smelt_ds.train ...``, ``python -m smelt_ds.train ...``) with the environment of :func:`fault_env`::

    env = {**os.environ, **fault_env(["nan:rank=1:step=4", "save_error:rank=1:step=6:errno=EIO"])}

It puts ``smelt_ds/testing/fault_site`` (a ``sitecustomize.py`` only) first on ``PYTHONPATH`` and
the specs in ``SMELT_FAULTS``. Python imports ``sitecustomize`` at the start of every process (the
launchers pass the environment on to the ranks), which calls :func:`install_from_env`. In a
training process (``RANK`` or ``LOCAL_RANK`` set, or started as ``-m smelt_ds.train``, ``-m
smelt_ds.cli train``, ``smelt-ds train``) that installs an import hook: when
``smelt_ds.train.loop`` is imported, its module-level ``_train_step``, ``total_loss`` and step-end
collective (``sync_flag`` or ``agree``, whichever the loop has) are wrapped, and ``open`` too when
a ``save_error`` is asked for. Elsewhere (the launchers) nothing is patched.

Specs: ``kind:key=value:...``, several separated by ``;``. The step is the optimizer step being
trained, 1-based, as the loop counts it (after a resume from step 50 the first is 51); the rank
is ``RANK`` (0 when unset). Each fault fires at most once per process.

- ``nan:rank=R:step=S``: the training loss of rank R at step S is multiplied by NaN (the graph
  and the gradients are NaN);
- ``spike:rank=R:step=S:factor=F``: the loss of rank R at step S is multiplied by F;
- ``sleep:rank=R:step=S:seconds=X``: rank R sleeps X seconds in the control collective of step S
  (``agree``, at the accumulation boundary, after the step's forward and backward), as a rank
  hung in or around a collective;
- ``raise:rank=R:step=S``: rank R raises ``RuntimeError("injected fault: rank R step S")`` at the
  start of step S;
- ``save_error:rank=R:step=S[:errno=ENOSPC]``: rank R fails to write its first file of the
  checkpoint of step S (under ``checkpoints/stepSSSSSSSS/``): ``EACCES``, ``EPERM`` and ``EROFS``
  from ``open``, ``ENOSPC`` (the default), ``EDQUOT`` and ``EIO`` from the file's first ``write``,
  where a real file system reports them;
- ``exit:rank=R:step=S``: rank R ends with ``os._exit(137)`` at the start of step S (no traceback,
  no cleanup: as a SIGKILL or an out-of-memory kill).

A bad spec raises ValueError naming it (:func:`fault_env` checks the specs before any process
starts; in ``sitecustomize`` Python would only print the error).
"""

from __future__ import annotations

import builtins
import errno
import functools
import importlib.abc
import importlib.machinery
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["FAULTS_ENV", "SITE_DIR", "KINDS", "Fault", "parse_faults", "fault_env", "install_from_env", "install",
           "patch_loop", "is_training_process"]

#: the environment variable holding the fault specs (``;``-separated)
FAULTS_ENV = "SMELT_FAULTS"
#: the directory put first on ``PYTHONPATH``: its ``sitecustomize.py`` calls :func:`install_from_env`
SITE_DIR = Path(__file__).resolve().parent / "fault_site"
#: the module whose functions are wrapped
LOOP_MODULE = "smelt_ds.train.loop"

#: kind -> (required keys, optional keys)
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "nan": (("rank", "step"), ()),
    "spike": (("rank", "step", "factor"), ()),
    "sleep": (("rank", "step", "seconds"), ()),
    "raise": (("rank", "step"), ()),
    "save_error": (("rank", "step"), ("errno",)),
    "exit": (("rank", "step"), ()),
}
#: the errors a ``save_error`` may raise; the first three from ``open``, the others from ``write``
SAVE_ERRNOS = {"EACCES": errno.EACCES, "EPERM": errno.EPERM, "EROFS": errno.EROFS,
               "ENOSPC": errno.ENOSPC, "EDQUOT": errno.EDQUOT, "EIO": errno.EIO}
_AT_OPEN = {errno.EACCES, errno.EPERM, errno.EROFS}


@dataclass(frozen=True)
class Fault:
    """One parsed spec: ``kind``, the ``rank`` and ``step`` it fires at, and its parameter
    (``factor`` of a spike, ``seconds`` of a sleep, ``errno`` of a save error)."""

    kind: str
    rank: int
    step: int
    factor: float = 1.0
    seconds: float = 0.0
    errno: int = errno.ENOSPC
    spec: str = ""


def _bad(spec: str, why: str) -> ValueError:
    kinds = ", ".join(KINDS)
    return ValueError(f"bad fault spec {spec!r}: {why} (expected kind:key=value:..., kinds {kinds}; e.g. "
                      "nan:rank=1:step=4, sleep:rank=0:step=3:seconds=30, save_error:rank=1:step=6:errno=EIO)")


def _parse_one(spec: str) -> Fault:
    kind, *pairs = [p.strip() for p in spec.split(":")]
    if kind not in KINDS:
        raise _bad(spec, f"unknown kind {kind!r}")
    required, optional = KINDS[kind]
    values: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise _bad(spec, f"{pair!r} is not key=value")
        if key not in required + optional:
            raise _bad(spec, f"{kind} takes {', '.join(required + optional)}, not {key!r}")
        if key in values:
            raise _bad(spec, f"{key} given twice")
        values[key] = value
    missing = [k for k in required if k not in values]
    if missing:
        raise _bad(spec, f"{kind} needs {', '.join(missing)}")

    def integer(key: str, least: int) -> int:
        try:
            n = int(values[key])
        except ValueError:
            raise _bad(spec, f"{key}={values[key]!r} is not an integer") from None
        if n < least:
            raise _bad(spec, f"{key}={n} is below {least}")
        return n

    def number(key: str) -> float:
        try:
            x = float(values[key])
        except ValueError:
            raise _bad(spec, f"{key}={values[key]!r} is not a number") from None
        if not math.isfinite(x) or (key == "seconds" and x < 0):
            raise _bad(spec, f"{key}={values[key]} is not a finite{' non-negative' if key == 'seconds' else ''} "
                             "number")
        return x

    fault = Fault(kind, integer("rank", 0), integer("step", 1), spec=spec)
    if kind == "spike":
        fault = Fault(kind, fault.rank, fault.step, factor=number("factor"), spec=spec)
    elif kind == "sleep":
        fault = Fault(kind, fault.rank, fault.step, seconds=number("seconds"), spec=spec)
    elif kind == "save_error":
        name = values.get("errno", "ENOSPC").upper()
        if name not in SAVE_ERRNOS:
            raise _bad(spec, f"errno={values['errno']!r} is not one of {', '.join(SAVE_ERRNOS)}")
        fault = Fault(kind, fault.rank, fault.step, errno=SAVE_ERRNOS[name], spec=spec)
    return fault


def parse_faults(text: str | Sequence[str]) -> list[Fault]:
    """The faults of ``text`` (``;``-separated specs) or of a list of specs. Blank parts are
    skipped. Raises ValueError naming the first bad spec."""
    parts = text.split(";") if isinstance(text, str) else [p for s in text for p in s.split(";")]
    return [_parse_one(p.strip()) for p in parts if p.strip()]


def fault_env(specs: str | Sequence[str], pythonpath: str | None = None) -> dict[str, str]:
    """The environment variables that inject ``specs`` into every training process started with
    them: ``PYTHONPATH`` (:data:`SITE_DIR` first, then ``pythonpath``, by default the current
    ``PYTHONPATH``) and ``SMELT_FAULTS``. Merge them into ``os.environ`` (or a copy). Raises
    ValueError naming a bad spec."""
    faults = parse_faults(specs)
    existing = os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath
    path = str(SITE_DIR) + (os.pathsep + existing if existing else "")
    return {"PYTHONPATH": path, FAULTS_ENV: ";".join(f.spec.strip() for f in faults)}


def is_training_process(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> bool:
    """Whether this process trains: ``RANK`` or ``LOCAL_RANK`` is set (a rank under a launcher), or
    the command is ``python -m smelt_ds.train``, ``python -m smelt_ds.cli train`` or ``smelt-ds
    train`` (``argv``: by default ``sys.orig_argv``, the command line as given)."""
    environ = os.environ if environ is None else environ
    if environ.get("RANK") is not None or environ.get("LOCAL_RANK") is not None:
        return True
    args = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    for i, a in enumerate(args):
        if a == "-m" and i + 1 < len(args):
            module, rest = args[i + 1], args[i + 2:]
            return module == "smelt_ds.train" or (module == "smelt_ds.cli" and "train" in rest[:1])
        if Path(a).name == "smelt-ds":
            return "train" in args[i + 1:i + 2]
    return False


class _Injector:
    """The faults of this rank and the step being trained (set by the ``_train_step`` wrapper)."""

    def __init__(self, faults: list[Fault], rank: int):
        self.rank = rank
        self.faults = [f for f in faults if f.rank == rank]
        self.fired: set[int] = set()
        self.step = 0  # the step being trained (1-based); 0 before the first
        self.in_step = False

    def due(self, kinds: tuple[str, ...], step: int) -> list[Fault]:
        """The faults of ``kinds`` at ``step`` not fired yet; marked fired."""
        out = []
        for i, f in enumerate(self.faults):
            if f.kind in kinds and f.step == step and i not in self.fired:
                self.fired.add(i)
                out.append(f)
        return out

    def save_fault(self, path: str) -> Fault | None:
        """The ``save_error`` (not fired yet) whose checkpoint directory holds ``path``; marked fired."""
        for i, f in enumerate(self.faults):
            if f.kind == "save_error" and i not in self.fired and \
                    f"{os.sep}checkpoints{os.sep}step{f.step:08d}{os.sep}" in path:
                self.fired.add(i)
                return f
        return None


class _FailingWrites:
    """A file opened for writing whose ``write`` fails with ``code`` (as a full disk or a failing
    device answers); everything else is the real file's."""

    def __init__(self, f, code: int):
        self._f, self._code = f, code

    def write(self, b):
        raise OSError(self._code, os.strerror(self._code))

    def writelines(self, lines):
        raise OSError(self._code, os.strerror(self._code))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()
        return False

    def __getattr__(self, name):
        return getattr(self._f, name)


def _failing_open(injector: _Injector, real_open: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real_open)
    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            path = os.path.abspath(os.fsdecode(file))
            fault = injector.save_fault(path)
            if fault is not None:
                if fault.errno in _AT_OPEN:
                    raise OSError(fault.errno, os.strerror(fault.errno), path)
                return _FailingWrites(real_open(file, mode, *args, **kwargs), fault.errno)
        return real_open(file, mode, *args, **kwargs)

    return open_


def patch_loop(loop: Any, injector: _Injector) -> None:
    """Wrap ``loop``'s (the module :data:`LOOP_MODULE`, or a stand-in with the same names)
    ``_train_step``, ``total_loss`` and step-end collective (``sync_flag``/``agree``) with the
    faults of ``injector``."""
    real_step, real_loss = loop._train_step, loop.total_loss

    @functools.wraps(real_step)
    def _train_step(fit, *args, **kwargs):
        step = fit.step + 1
        injector.step = step
        for f in injector.due(("exit", "raise"), step):
            if f.kind == "exit":
                os._exit(137)
            raise RuntimeError(f"injected fault: rank {injector.rank} step {step}")
        injector.in_step = True
        try:
            return real_step(fit, *args, **kwargs)
        finally:
            injector.in_step = False

    @functools.wraps(real_loss)
    def total_loss(*args, **kwargs):
        loss = real_loss(*args, **kwargs)
        if injector.in_step:  # not validation
            for f in injector.due(("nan", "spike"), injector.step):
                loss = loss * (float("nan") if f.kind == "nan" else f.factor)
        return loss

    loop._train_step, loop.total_loss = _train_step, total_loss
    for name in ("sync_flag", "agree"):  # the step-end collective (its name changed over time)
        real = getattr(loop, name, None)
        if real is not None:
            setattr(loop, name, _sleeping(real, injector))


def _sleeping(real: Callable[..., Any], injector: _Injector) -> Callable[..., Any]:
    @functools.wraps(real)
    def collective(*args, **kwargs):
        for f in injector.due(("sleep",), injector.step):
            time.sleep(f.seconds)
        return real(*args, **kwargs)

    return collective


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that lets :data:`LOOP_MODULE` load as usual, then patches it."""

    def __init__(self, patch: Callable[[ModuleType], None]):
        self.patch = patch

    def find_spec(self, fullname, path, target=None):
        if fullname != LOOP_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, self.patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, patch: Callable[[ModuleType], None]):
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def install(faults: list[Fault], rank: int) -> _Injector:
    """Inject ``faults`` into this process as rank ``rank``: patch :data:`LOOP_MODULE` now if it
    is imported, else when it is (an import hook); with a ``save_error`` of this rank, ``open``
    too (when the loop is patched). Returns the injector (its ``fired`` set says what fired)."""
    injector = _Injector(faults, rank)

    def patch(loop: ModuleType) -> None:
        patch_loop(loop, injector)
        if any(f.kind == "save_error" for f in injector.faults):
            builtins.open = _failing_open(injector, builtins.open)

    if LOOP_MODULE in sys.modules:
        patch(sys.modules[LOOP_MODULE])
    else:
        sys.meta_path.insert(0, _PatchOnImport(patch))
    return injector


def install_from_env() -> _Injector | None:
    """``sitecustomize``'s call: :func:`install` the faults of ``SMELT_FAULTS`` as rank ``RANK``
    (0 when unset) in a training process (:func:`is_training_process`). Nothing when the
    variable is unset or blank, or in another process (a launcher). Raises ValueError naming a
    bad spec."""
    text = os.environ.get(FAULTS_ENV, "")
    if not text.strip():
        return None
    faults = parse_faults(text)
    if not is_training_process():
        return None
    return install(faults, int(os.environ.get("RANK", "0")))
