"""``python -m smelt_ds.train RECIPE``: the per-rank entry point the deepspeed launcher and torchrun start."""

import sys

from smelt_ds.train.loop import main

sys.exit(main())
