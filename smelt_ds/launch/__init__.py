"""Multi-node jobs: hostfiles and Slurm node lists, job plans, rendering of deepspeed / Slurm /
Kubernetes job files from the templates in ``launchers/``.

- :mod:`smelt_ds.launch.placement`: a recipe resolved for a cluster layout and world size, its memory
  verdict there (shared with ``smelt-ds memory``, the recipe table and sweeps).
- :mod:`smelt_ds.launch.jobs`; ``python -m smelt_ds.launch hostnames|hostfile``.
- Commands: ``smelt-ds render-job`` (:mod:`smelt_ds.launch.cli`).
"""
