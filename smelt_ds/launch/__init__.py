"""Multi-node jobs: hostfiles and Slurm node lists, job plans, rendering of deepspeed / Slurm /
Kubernetes job files from the templates in ``launchers/``.

- :mod:`smelt_ds.launch.jobs`; ``python -m smelt_ds.launch hostnames|hostfile``.
- Commands: ``smelt-ds render-job`` (:mod:`smelt_ds.launch.cli`).
"""
