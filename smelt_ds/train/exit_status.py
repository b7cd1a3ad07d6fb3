"""Each rank's exit status in a file, for a job script to read: torchrun reports any failed rank as
exit status 1, so a Slurm script or a Kubernetes pod could not otherwise tell a bad configuration
(2: failing again is certain) from a lost peer (75: a restart may succeed).

When :data:`EXIT_STATUS_ENV` (``SMELT_EXIT_STATUS_DIR``) names a directory, the rank entry point
(:mod:`smelt_ds.train.__main__`) writes its documented exit status (docs/faults.md) there as
``rank<RANK>`` (``RANK`` from the launcher, else 0), one decimal number and a newline, just before it
exits. A rank that ends without returning (killed, the hang watchdog's ``os._exit``) writes nothing;
the rendered jobs look for the statuses that must not restart (:data:`NO_RESTART`) and report the
first of them any rank wrote instead of the launcher's status.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["EXIT_STATUS_ENV", "NO_RESTART", "write_exit_status"]

#: environment variable naming the directory of the ranks' exit-status files
EXIT_STATUS_ENV = "SMELT_EXIT_STATUS_DIR"
#: the statuses a job must not restart, most telling first: 2 (bad configuration), 3 (non-finite steps)
NO_RESTART = (2, 3)


def write_exit_status(status: int, env: Mapping[str, str] | None = None) -> Path | None:
    """Write ``status`` to ``$SMELT_EXIT_STATUS_DIR/rank<RANK>`` when the variable is set; returns
    the file, or None when it is unset or the file cannot be written (the status then reaches the
    job only through the launcher; never an error of its own)."""
    env = os.environ if env is None else env
    where = env.get(EXIT_STATUS_ENV)
    if not where:
        return None
    path = Path(where) / f"rank{env.get('RANK', '0')}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{status}\n")
    except OSError:
        return None
    return path

