"""``python -m smelt_ds.train RECIPE``: the per-rank entry point the deepspeed launcher and torchrun start.

A run that ended on every rank together tears its process group down
(:func:`smelt_ds.train.loop.run_and_report`). A rank whose run failed (a peer died or hung, an
unexpected error) still holds a group that may be broken: it can neither be destroyed (the
teardown may wait on the dead peer) nor left to the interpreter's finalization. Either way the
rank then flushes its output and ends with :func:`os._exit` with its documented status: the
interpreter's finalization can abort a process whose run used Gloo with ``terminate called
without an active exception`` (exit 134; pytorch/pytorch#190489), seen here once in about ten
suites even after a clean stop whose group was destroyed. Everything the run writes
(``metrics.jsonl``, TensorBoard, trackers, checkpoints) is closed or flushed before
:func:`smelt_ds.train.loop.main` returns. With ``SMELT_EXIT_STATUS_DIR`` set, the status is also
written to a file there (:mod:`smelt_ds.train.exit_status`), for the rendered Slurm and Kubernetes
jobs, which cannot read it through torchrun.
"""

import logging
import os
import sys

from smelt_ds.train.exit_status import write_exit_status
from smelt_ds.train.loop import main

try:
    status = main()
except SystemExit as e:  # argparse's usage error (2), as a bad configuration
    status = e.code if isinstance(e.code, int) else 1
write_exit_status(status)  # for the job script: torchrun reports any failed rank as 1
sys.stdout.flush()
sys.stderr.flush()
logging.shutdown()
os._exit(status)
