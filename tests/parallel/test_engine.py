"""Optimizer groups, LR schedules, the global batch and backend refusals (single process, no training)."""

from __future__ import annotations

import math

import pytest

from smelt_ds.config.loading import config_from_dict
from smelt_ds.config.train import resolve_batch
from smelt_ds.errors import ConfigError
from smelt_ds.model import SmeltLM
from smelt_ds.parallel.engine import lr_multiplier, param_groups

TINY = {"model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16}}


def _cfg(**sections):
    raw = {k: dict(v) for k, v in TINY.items()}
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v}
    return config_from_dict(raw)


def test_global_batch_consistency():
    cfg = _cfg(train={"micro_batch_size": 4, "seq_len": 32, "global_batch_tokens": 4 * 32 * 2 * 3})
    assert resolve_batch(cfg.train, 2) == (3, 768)
    with pytest.raises(ConfigError, match="train.global_batch_tokens") as e:
        resolve_batch(cfg.train, 4)  # 768 / (4*32*4) is not an integer
    # the nearest working values: 768 tokens = 6 micro-batches of 128, so 3 or 6 ranks; on 4 ranks
    # (512 tokens per step) the multiples 512 and 1,024 around 768
    assert "run on 3 or 6 ranks" in str(e.value) and "to 512 or 1,024 on 4 rank(s)" in str(e.value)
    for near in (3, 6):
        assert resolve_batch(cfg.train, near)[1] == 768
    cfg = _cfg(train={"micro_batch_size": 4, "seq_len": 32, "global_batch_tokens": 256,
                      "gradient_accumulation_steps": 3})
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        resolve_batch(cfg.train, 1)


def test_config_refuses_bad_backend_combinations():
    with pytest.raises(ConfigError, match="autoep"):
        _cfg(moe_runtime={"backend": "deepspeed"}, deepspeed={"zero_stage": 3})
    with pytest.raises(ConfigError, match="moe.aux_loss_free_bias"):
        _cfg(moe={"aux_loss_free_bias": True}, moe_runtime={"backend": "autoep"})
    with pytest.raises(ConfigError, match="deepspeed.offload_param"):
        _cfg(deepspeed={"zero_stage": 2, "offload_param": "cpu"})
    with pytest.raises(ConfigError, match="train.seq_len"):
        _cfg(train={"seq_len": 100000})


def test_param_groups_decay_and_shared_lr_scale():
    cfg = _cfg(loop={"position": "middle", "shared_lr_scale": 0.5})
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    groups = param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    seen = [names[id(p)] for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(names.values())  # every parameter exactly once
    looped_layers = {1, 2}  # middle half of 4 layers
    for g in groups:
        for p in g["params"]:
            n = names[id(p)]
            no_decay = p.ndim < 2 or "norm" in n or "embed_tokens" in n
            assert g["weight_decay"] == (0.0 if no_decay else cfg.train.weight_decay), n
            is_looped = n.startswith("layers.") and int(n.split(".")[1]) in looped_layers
            assert g["lr_scale"] == (0.5 if is_looped else 1.0), n


def test_lr_schedules_against_formulas():
    cfg = _cfg(train={"max_steps": 100, "warmup_steps": 10, "min_lr_ratio": 0.1, "schedule": "cosine"})
    f = lr_multiplier(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert f(100) == pytest.approx(0.1)
    cfg = _cfg(train={"max_steps": 100, "warmup_steps": 10, "min_lr_ratio": 0.0, "schedule": "wsd",
                      "decay_fraction": 0.2})
    f = lr_multiplier(cfg)
    assert f(50) == 1.0 and f(79) == 1.0
    assert f(90) == pytest.approx(0.5) and f(100) == pytest.approx(0.0)
    cfg = _cfg(train={"max_steps": 10, "warmup_steps": 0, "schedule": "constant"})
    assert lr_multiplier(cfg)(7) == 1.0
