"""``python -m smelt_ds.train RECIPE``: the per-rank entry point the deepspeed launcher and torchrun start.

A run that ended on every rank together tears its process group down
(:func:`smelt_ds.train.loop.run_and_report`) and exits normally. A rank whose run failed (a peer
died or hung, an unexpected error) still holds a group that may be broken: it can neither be
destroyed (the teardown may wait on the dead peer) nor left to the interpreter's finalization
(Gloo's worker threads can abort the process there, exit 134 instead of the documented status).
Such a rank flushes its output and ends with :func:`os._exit`; its files (``metrics.jsonl``,
TensorBoard, checkpoints) were written or flushed before.
"""

import os
import sys

import torch.distributed as dist

from smelt_ds.train.loop import main

status = main()
if dist.is_available() and dist.is_initialized():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
sys.exit(status)
