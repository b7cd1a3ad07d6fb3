"""Fixtures of the evaluation tests: one test cache with the built-in corpus prepared once per
session, a tiny SMELT run trained once (20 steps), and a random-weight Baseline export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.markers import slow_fixture
from tests.threads import one_thread


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch, tmp_path):
    """One intra-op thread (tiny tensors on a shared 2-core machine) and no writes to ~/.cache."""
    monkeypatch.setenv("SMELT_DS_CACHE", str(tmp_path / "default-cache"))
    with one_thread(seed=0):
        yield


@pytest.fixture(scope="session")
def eval_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eval-cache")


@pytest.fixture(scope="session")
def smelt_cfg(eval_cache):
    from smelt_ds.config.loading import config_from_dict
    from tests.eval.eval_test_utils import tiny_raw

    return config_from_dict(tiny_raw(eval_cache))


@pytest.fixture(scope="session")
def eval_data(smelt_cfg):
    """The tiny recipes' prepared data (built-in corpus, 512-token tokenizer) as EvalData."""
    from smelt_ds.eval.data import open_eval_data

    return open_eval_data(smelt_cfg)


@pytest.fixture(scope="session")
def random_exports(tmp_path_factory, eval_cache, eval_data):
    """Random-weight exports ``{"baseline": dir, "smelt": dir}`` (init_std 0.2 so that attention
    and routing are far from uniform)."""
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.model import SmeltLM
    from tests.eval.eval_test_utils import baseline_raw, export_model, tiny_raw

    root = tmp_path_factory.mktemp("exports")
    out = {}
    for name, raw in (("baseline", baseline_raw(eval_cache)), ("smelt", tiny_raw(eval_cache))):
        raw["model"]["init_std"] = 0.2
        torch.manual_seed(1)
        cfg = config_from_dict(raw)
        out[name] = export_model(SmeltLM(cfg.model, cfg.moe, cfg.loop), cfg, root / name)
    return out


@pytest.fixture(scope="session")
@slow_fixture
def trained_run(tmp_path_factory, eval_cache, eval_data) -> Path:
    """A tiny SMELT run directory trained for 20 steps (checkpoint at step 20)."""
    from smelt_ds.testing import run_distributed
    from tests.eval.eval_test_utils import tiny_raw, train_worker

    raw = tiny_raw(eval_cache, tmp_path_factory.mktemp("trained") / "run")
    return Path(run_distributed(train_worker, 1, args=(raw,), timeout=300)[0])
