"""Fixtures of the data-pipeline tests: isolated caches and the built-in corpus prepared once."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Every test gets its own default cache, so nothing is read from or written to ~/.cache."""
    monkeypatch.setenv("SMELT_DS_CACHE", str(tmp_path / "default-cache"))


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    """One cache shared by the session (built-in corpus and its tokenizer are built once)."""
    return tmp_path_factory.mktemp("smelt-ds-cache")


@pytest.fixture(scope="session")
def builtin_prepared(session_cache):
    """The default recipe's data (built-in corpus) with a 512-token vocabulary, prepared once."""
    from smelt_ds.config.data import DataConfig
    from smelt_ds.data.prepare import prepare_from_config

    cfg = DataConfig(tokenizer={"vocab_size": 512})
    return prepare_from_config(cfg, session_cache)


@pytest.fixture(scope="session")
def two_domains(tmp_path_factory):
    """WikiText-2 + Tiny Shakespeare slices prepared as two domains (skips if the corpora are absent)."""
    from smelt_ds.data.prepare import prepare_from_config
    from tests.data.data_test_utils import two_domain_config

    return prepare_from_config(two_domain_config(tmp_path_factory.mktemp("two")))
