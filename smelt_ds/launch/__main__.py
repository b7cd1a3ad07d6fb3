"""``python -m smelt_ds.launch hostnames NODELIST`` / ``hostfile NODELIST --slots N`` (used inside job scripts)."""

import sys

from smelt_ds.launch.jobs import main

sys.exit(main())
