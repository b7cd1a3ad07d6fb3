"""Imported by Python at the start of every process of ``smelt-ds train --nproc N``'s deepspeed
launcher (:func:`smelt_ds.train.loop.launcher_command` puts this directory first on
``PYTHONPATH``): DeepSpeed's ``runner.py`` and ``launch.py`` do not import smelt_ds, so without
this they would import MLflow through DeepSpeed's autotuner on every start (about 2 s of CPU each
on a 2-core machine; :mod:`smelt_ds.import_hooks`). Importing ``smelt_ds`` installs that hook.

Python imports only the first ``sitecustomize`` on ``sys.path``; the one this shadows (the next on
``sys.path``: a user's, an environment's, a test's fault injector) is then executed as well.
"""

import importlib.util
import os
import sys


def _run_the_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        path = os.path.join(folder, "sitecustomize.py")
        if folder == here or not os.path.isfile(path):
            continue
        spec = importlib.util.spec_from_file_location("_smelt_ds_next_sitecustomize", path)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return


try:
    import smelt_ds  # noqa: F401  (installs smelt_ds.import_hooks)
except ImportError:  # another environment's Python: nothing to install
    pass
_run_the_next_sitecustomize()
