"""Shared test helpers: tiny configs built from plain dicts."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from tests.markers import slow_fixture

T = TypeVar("T")

TINY = {
    "model": {"vocab_size": 61, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
              "max_seq_len": 32, "dense_ffn_size": 48, "init_std": 0.2},
    "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 24},
    "train": {"seq_len": 16},
}


@pytest.fixture
def tiny_cfg():
    """``tiny_cfg({"loop": {...}})`` -> a validated RunConfig of a 4-layer, 32-wide model."""
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.mappings import deep_merge

    def make(overrides: dict | None = None):
        return config_from_dict(deep_merge(TINY, overrides or {}))

    return make


def once_per_run(tmp_path_factory, name: str, make: Callable[[Path], T], load: Callable[[Path], T]) -> T:
    """A session fixture's files built once per pytest run, also when pytest-xdist splits the
    session over worker processes (``pytest -n 2``, README): ``make(directory)`` builds them and
    returns the fixture's value, ``load(directory)`` returns the value from files already built.

    Without workers, ``make`` runs in a fresh temporary directory. With workers, the directory is
    ``name`` beside the workers' own base directories (pytest-xdist's documented recipe): the first
    worker to take the lock builds it, marks it done, and the others wait for the lock and ``load``
    it. A build that failed part-way (no done mark) is removed and built again by the next worker."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return make(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent / name
    with FileLock(f"{root}.lock"):
        done = root / ".built"
        if done.is_file():
            return load(root)
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        value = make(root)
        done.touch()
        return value


@pytest.fixture(scope="session")
@slow_fixture
def two_rank_reference(tmp_path_factory):
    """An uninterrupted 2-rank training of the shared recipe (:mod:`tests.two_ranks`), trained once
    per run (:func:`once_per_run`): a :class:`tests.two_ranks.Reference`. Read-only: a test that
    changes the run copies it first."""
    from tests.two_ranks import load_reference, train_reference

    return once_per_run(tmp_path_factory, "two-ranks", train_reference, load_reference)


def pytest_collection_modifyitems(config, items):
    """``slow`` also covers the ``distributed`` tests (they start processes) and the tests that use
    a fixture marked by :func:`tests.markers.slow_fixture`."""
    for item in items:
        if item.get_closest_marker("slow"):
            continue
        definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        uses_slow_fixture = any(getattr(defs[-1].func, "smelt_slow", False)
                                for name in item.fixturenames if (defs := definitions.get(name)))
        if item.get_closest_marker("distributed") or uses_slow_fixture:
            item.add_marker(pytest.mark.slow)
