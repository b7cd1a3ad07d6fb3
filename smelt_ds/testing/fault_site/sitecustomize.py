"""Imported by Python at the start of every process that has this directory on ``PYTHONPATH``
(:func:`smelt_ds.testing.faults.fault_env` puts it there): injects the faults of ``SMELT_FAULTS``
into training processes (:func:`smelt_ds.testing.faults.install_from_env`)."""

import os

if os.environ.get("SMELT_FAULTS", "").strip() or os.environ.get("SMELT_LEDGER", "").strip():  # else nothing imported
    from smelt_ds.testing.faults import install_from_env

    install_from_env()
