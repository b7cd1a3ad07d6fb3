"""Shared test helpers: tiny configs built from plain dicts."""

from __future__ import annotations

import pytest

from tests.markers import slow_fixture

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


@pytest.fixture(scope="session")
@slow_fixture
def two_rank_reference(tmp_path_factory):
    """An uninterrupted 2-rank training of the shared recipe (:mod:`tests.two_ranks`), trained once
    per session: a :class:`tests.two_ranks.Reference`."""
    from tests.two_ranks import train_reference

    return train_reference(tmp_path_factory.mktemp("two-ranks"))


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
