"""The DeepSpeed config assembler (:func:`smelt_ds.parallel.ds_config.build_ds_config`), single process.

Test model of :func:`test_every_section_follows_from_the_config`: 4 unique layers, middle loop
(plan ``0 1 2 1 2 3``), hidden 32, 4 heads of 8 (2 KV heads), 4 experts of FFN 16. Parameter
elements one visit gathers per GPU (``tests/cost/test_zero3_tuning.py``): attention
``2*32*32 + 2*32*16 = 3072``, norms 64, router 128, experts ``4*3*32*16 = 6144``, divided by the
expert-parallel size 2 with an EP backend (3072). So a layer gathers 9408 elements (reference) or
6336 (EP backends), and the looped block [1, 3) twice that.
"""

from __future__ import annotations

import json

import deepspeed.runtime.config as ds_runtime_config
import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from smelt_ds.config.loading import config_from_dict
from smelt_ds.errors import ConfigError
from smelt_ds.parallel import zero_section as zero_section_mod
from smelt_ds.parallel.ds_config import build_ds_config, expert_parallel_section, gradient_clipping
from smelt_ds.parallel.zero_section import template_name
from smelt_ds.resources import DS_CONFIG_DIR
from tests.parallel.moe_backends.backend_helpers import tiny_cfg
from tests.parallel.test_engine import _cfg
from tests.parallel.test_grad_norm import CLIP, make_cfg

#: elements one visit gathers per GPU (module docstring), by backend
LAYER_NUMEL = {"reference": 9408, "deepspeed": 6336, "autoep": 6336}
#: the three ZeRO-3 values the test templates set, below any reuse gap of the test model
SMALL = {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 0}
CASES = [(stage, backend) for stage in range(4) for backend in ("reference", "deepspeed", "autoep")
         if not (backend == "deepspeed" and stage == 3)]  # the config refuses DeepSpeed-MoE at ZeRO-3


def _section_cfg(stage: int, backend: str):
    """One recipe per case: 2 ranks, micro-batch 2 of 16 tokens, 3 accumulation steps; bf16 at
    even stages; comms logger at stage 1; optimizer offload at stages 2 and 3 with the reference backend;
    AutoEP with sigmoid scores and no top-k renormalisation (values that differ from the defaults)."""
    runtime = {"backend": backend} if backend == "reference" else {"backend": backend, "ep_size": 2,
                                                                    "drop_tokens": False}
    autoep = backend == "autoep"
    raw = {"name": "sections",
           "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                     "max_seq_len": 32},
           "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16,
                   "score_func": "sigmoid" if autoep else "softmax", "norm_topk_prob": not autoep},
           "moe_runtime": runtime, "loop": {"position": "middle"},
           "train": {"seq_len": 16, "micro_batch_size": 2, "global_batch_tokens": 2 * 16 * 2 * 3, "grad_clip": 0.7,
                     "precision": "bf16" if stage % 2 == 0 else "fp32", "lr": 1e-3, "betas": [0.8, 0.9],
                     "eps": 1e-7, "weight_decay": 0.05},
           "deepspeed": {"zero_stage": stage, "comms_logger": stage == 1,
                         "offload_optimizer": "cpu" if stage >= 2 and backend == "reference" else "none"}}
    return config_from_dict(raw)


@pytest.fixture
def templates(tmp_path, monkeypatch):
    """The shipped templates with SMALL as the ZeRO-3 values (so the loop tuning visibly raises
    them) and 1000-element reduce buckets (so the memory check passes on any machine: the tiny
    model needs about 0.1 MB more gathered); the assembler reads them from ``tmp_path``."""
    for path in DS_CONFIG_DIR.glob("*.json"):
        t = json.loads(path.read_text())
        if t["zero_optimization"]["stage"] == 3:
            t["zero_optimization"].update(SMALL, reduce_bucket_size=1000)
        (tmp_path / path.name).write_text(json.dumps(t))
    monkeypatch.setattr(zero_section_mod, "DS_CONFIG_DIR", tmp_path)
    return tmp_path


@pytest.mark.parametrize("stage,backend", CASES)
def test_every_section_follows_from_the_config(stage, backend, templates):
    """Template keys, batch, precision, clipping, ZeRO with the loop-aware values, AutoEP and the
    optional sections, each against the value derived by hand from the recipe, in the key order
    that ``ds_config.json`` is written in."""
    cfg = _section_cfg(stage, backend)
    offload = stage >= 2 and backend == "reference"
    name = "zero3_offload_optimizer" if offload and stage == 3 else f"zero{stage}"
    template = json.loads((templates / f"{name}.json").read_text())
    zero = dict(template["zero_optimization"])
    if stage == 3:  # block order, no checkpointing: the block's other layer + the layer itself
        layer = LAYER_NUMEL[backend]
        zero.update(stage3_max_reuse_distance=2 * layer, stage3_prefetch_bucket_size=layer,
                    stage3_max_live_parameters=2 * layer + 2 * layer)
    if offload and stage == 2:  # zero2.json has no offload section: the recipe's device is added
        zero["offload_optimizer"] = {"device": "cpu"}
    want = {**template, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
            "train_batch_size": 2 * 3 * 2,
            "gradient_clipping": 0.0 if backend != "reference" and stage == 0 else 0.7,
            "bf16": {"enabled": stage % 2 == 0}, "zero_optimization": zero}
    if backend == "autoep":
        want["expert_parallel"] = {
            "enabled": True, "autoep_size": 2, "moe_layer_pattern": r"layers\.\d+\.mlp", "router_pattern": "gate",
            "expert_pattern": "experts", "expert_w1": "gate_up_proj", "expert_w2": "down_proj", "expert_w3": None,
            "top_k": 2, "score_func": "sigmoid", "score_apply": "post", "route_norm": False, "route_scale": 1.0,
            "expert_activation": "swiglu", "use_grouped_mm": True,  # 2*32 and 2*16 bytes are multiples of 16
            "has_shared_experts": False}
    if stage == 1:
        want["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
    if offload:
        want["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.9], "eps": 1e-7,
                                                         "weight_decay": 0.05}}
    got = build_ds_config(cfg, 2)
    assert got == want
    assert list(got) == list(want)
    assert list(got["zero_optimization"]) == list(zero)


# ---------------------------------------------------------------------------------------------
# moved with the assembler from tests/parallel/test_engine.py, test_grad_norm.py, test_moe_backends.py
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ds", [
    {"zero_stage": 0}, {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3},
    {"zero_stage": 3, "offload_optimizer": "cpu"}, {"zero_stage": 3, "offload_param": "cpu"},
])
@pytest.mark.parametrize("world", [1, 4])
def test_ds_config_parses_with_deepspeed(ds, world, monkeypatch):
    cfg = _cfg(deepspeed=ds, train={"micro_batch_size": 3, "seq_len": 16, "global_batch_tokens": 3 * 16 * 2 * world})
    d = build_ds_config(cfg, world)

    class DataParallel:  # DeepSpeed reads the data-parallel size from an mpu object
        @staticmethod
        def get_data_parallel_world_size():
            return world

    monkeypatch.setattr(ds_runtime_config.dist, "get_rank", lambda: 0)
    parsed = DeepSpeedConfig(d, mpu=DataParallel())
    assert parsed.zero_optimization_stage == ds["zero_stage"]
    assert parsed.train_micro_batch_size_per_gpu == 3
    assert parsed.gradient_accumulation_steps == 2
    assert parsed.train_batch_size == 3 * 2 * world
    assert parsed.gradient_clipping == cfg.train.grad_clip
    assert not parsed.bfloat16_config.enabled  # CPU: fp32
    expected = {"zero_stage": 0, "offload_optimizer": "none", "offload_param": "none", **ds}
    assert template_name(cfg) == ("zero3_offload_param" if expected["offload_param"] != "none" else
                                  "zero3_offload_optimizer" if expected["offload_optimizer"] != "none" else
                                  f"zero{ds['zero_stage']}")
    if expected["offload_optimizer"] == "cpu":
        assert parsed.zero_config.offload_optimizer.device == "cpu"


def test_user_deepspeed_keys_pass_through_unchanged():
    extra = {"zero_optimization": {"stage3_max_live_parameters": 12345, "reduce_bucket_size": 777},
             "steps_per_print": 7, "some_future_key": {"a": [1, 2]}}
    cfg = _cfg(deepspeed={"zero_stage": 3, "config": extra})
    d = build_ds_config(cfg, 1)
    assert d["zero_optimization"]["stage3_max_live_parameters"] == 12345
    assert d["zero_optimization"]["reduce_bucket_size"] == 777
    assert d["zero_optimization"]["stage"] == 3  # template keys the user did not set stay
    assert d["steps_per_print"] == 7 and d["some_future_key"] == {"a": [1, 2]}


def test_unknown_template_is_refused():
    with pytest.raises(ConfigError, match="template"):
        build_ds_config(_cfg(deepspeed={"template": "zero9"}), 1)


def test_gradient_clipping_per_backend_and_stage():
    for backend in ("reference", "deepspeed", "autoep"):
        for stage in (0, 1, 2, 3):
            if backend == "deepspeed" and stage == 3:
                continue
            want = 0.0 if backend != "reference" and stage == 0 else CLIP
            assert gradient_clipping(make_cfg(backend, stage)) == want, (backend, stage)
    assert build_ds_config(make_cfg("autoep", 0), 2)["gradient_clipping"] == 0.0
    assert build_ds_config(make_cfg("autoep", 2), 2)["gradient_clipping"] == CLIP
    with pytest.raises(ConfigError, match=r"`deepspeed.config.gradient_clipping` \(0.5\) is set by the recipe "
                                          r"field train.grad_clip"):
        make_cfg("autoep", 0, config={"gradient_clipping": 0.5})


def test_expert_parallel_section_fields():
    cfg = tiny_cfg(backend="autoep", ep_size=2, shared_expert_ffn_size=8, norm_topk_prob=False)
    sec = expert_parallel_section(cfg)
    assert sec is not None
    assert sec["enabled"] is True and sec["autoep_size"] == 2 and sec["top_k"] == 2
    assert sec["moe_layer_pattern"] == r"layers\.\d+\.mlp" and sec["router_pattern"] == "gate"
    assert sec["expert_pattern"] == "experts" and sec["expert_w3"] is None
    assert (sec["expert_w1"], sec["expert_w2"]) == ("gate_up_proj", "down_proj")
    assert sec["route_norm"] is False and sec["score_func"] == "softmax"
    assert sec["has_shared_experts"] is True and sec["shared_experts_gate_pattern"] == "shared_expert_gate"
    assert "load_balance_coeff" not in sec
    assert expert_parallel_section(cfg, module_prefix="model.")["moe_layer_pattern"] == r"model\.layers\.\d+\.mlp"
