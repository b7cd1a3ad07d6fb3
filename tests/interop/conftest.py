"""Fixtures of the interop tests: the tiny recipes' prepared data (built-in corpus, 512-token
tokenizer) once per session, and random-weight smelt-ds exports with their tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.threads import one_thread


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch, tmp_path):
    """One intra-op thread, no writes to ~/.cache, the hub offline."""
    monkeypatch.setenv("SMELT_DS_CACHE", str(tmp_path / "default-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    with one_thread(seed=0):
        yield


@pytest.fixture(scope="session")
def interop_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("interop-cache")


@pytest.fixture(scope="session")
def interop_data(interop_cache):
    """EvalData of the tiny recipes (``.tokenizer``, ``.eot_id``, validation documents)."""
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.eval.data import open_eval_data
    from tests.eval.eval_test_utils import tiny_raw

    return open_eval_data(config_from_dict(tiny_raw(interop_cache)))


@pytest.fixture(scope="session")
def make_export(tmp_path_factory, interop_cache, interop_data):
    """``make_export(name, **sections)`` -> a random-weight export directory (model.pt, config.yaml,
    tokenizer.json) of the tiny SMELT recipe with ``sections`` merged in (``model={"qk_norm": True}``,
    ``loop={"position": "none"}``, ...); init_std 0.2 so attention and routing are far from uniform."""
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.model import SmeltLM
    from tests.eval.eval_test_utils import export_model, tiny_raw

    root = tmp_path_factory.mktemp("interop-exports")

    def make(name: str, **sections) -> Path:
        raw = tiny_raw(interop_cache, **sections)
        raw["name"] = name
        raw["model"].setdefault("init_std", 0.2)
        torch.manual_seed(1)
        cfg = config_from_dict(raw)
        out = export_model(SmeltLM(cfg.model, cfg.moe, cfg.loop), cfg, root / name)
        interop_data.tokenizer.save(str(out / "tokenizer.json"))
        return out

    return make
