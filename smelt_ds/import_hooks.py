"""Import hooks installed when ``smelt_ds`` is imported: start-up time of every rank.

DeepSpeed 0.19's autotuner (``deepspeed/autotuning/autotuner.py``), imported by
``deepspeed.runtime.config`` on every ``import deepspeed``, tries ``import mlflow`` to log its own
tuning experiments. With MLflow installed (``smelt-ds[mlflow]``, and the dev extra) that import
costs about 1 s of the 2.1 s ``import deepspeed`` takes on a 2-core CPU machine (``python -X
importtime``), paid once per rank, per CLI process and per test worker. smelt-ds never runs
DeepSpeed's autotuner inside its processes (``deepspeed --autotuning`` runs it in the launcher
process, which does not import smelt_ds; ``smelt-ds train --nproc`` gives its launcher's processes
the hook too, through ``smelt_ds/train/launcher_site/sitecustomize.py``), so
:class:`DeepSpeedAutotunerWithoutMlflow` refuses that one import while the autotuner module is being
executed: DeepSpeed's own ``try/except`` then sets its ``has_mlflow`` to False. Nothing is cached,
so ``import mlflow`` anywhere else (our MLflow tracker, the user's code) imports the real package.
Measured side by side: ``python bench/cli_startup.py`` (``import smelt_ds, deepspeed`` against
``import deepspeed``).
"""

from __future__ import annotations

import importlib.abc
import sys

AUTOTUNER = "deepspeed.autotuning.autotuner"


def _is_being_imported(name: str) -> bool:
    """Whether module ``name`` is executing its body now (its spec is marked ``_initializing``)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


class DeepSpeedAutotunerWithoutMlflow(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that raises ImportError for ``mlflow`` only while
    ``deepspeed.autotuning.autotuner`` is being imported; every other import passes through."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "mlflow" and _is_being_imported(AUTOTUNER):
            raise ImportError("smelt-ds does not run DeepSpeed's autotuner: its optional MLflow logging is "
                              "not imported (smelt_ds/import_hooks.py)")
        return None


def install() -> None:
    """Put :class:`DeepSpeedAutotunerWithoutMlflow` first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(f, DeepSpeedAutotunerWithoutMlflow) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedAutotunerWithoutMlflow())
