"""Loop-aware ZeRO-3 tuning: the values derived from the visit plan, and DeepSpeed's comms logger
counting the all-gather volume they save on 2 gloo ranks.

Test model: 4 unique layers, middle loop -> plan ``0 1 2 1 2 3`` (6 visits), hidden 32, 4 heads
of 8 (2 KV heads), 4 experts of FFN 16, vocabulary 64. Parameter elements per layer:
attention ``2*32*32 + 2*32*16 = 3072``, norms 64, router 128, experts ``4*3*32*16 = 6144``:
``P_layer = 9408``; the looped block [1, 3) holds ``P_span = 18816``.
"""

from __future__ import annotations

import json

import pytest
import torch

from smelt_ds.config.loading import config_from_dict
from smelt_ds.cost.zero3_tuning import KEYS, plan_zero3, reuse_distance_needed, trace, visit_numel
from smelt_ds.parallel import zero_section as zero_section_mod
from smelt_ds.parallel.ds_config import build_ds_config
from smelt_ds.parallel.zero_section import zero_section
from smelt_ds.runs.zero3_record import write_zero3_tuning
from smelt_ds.testing import run_distributed
from tests.markers import slow_fixture

P_LAYER, P_SPAN = 9408, 18816
SMALL = {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 0}


def _raw(tuning="auto", policy="none", order="block", position="middle", zero=None, stage=3, comms=False):
    return {"name": "z3", "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4,
                                    "num_kv_heads": 2, "max_seq_len": 32},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16},
            "loop": {"position": position, "order": order},
            "train": {"seq_len": 16, "micro_batch_size": 2, "lr": 1e-2, "warmup_steps": 1, "max_steps": 10,
                      "activation_checkpointing": {"policy": policy}},
            "deepspeed": {"zero_stage": stage, "zero3_loop_tuning": tuning, "comms_logger": comms,
                          "config": {"zero_optimization": dict(zero or {})}}}


def _cfg(**kw):
    return config_from_dict(_raw(**kw))


def test_visit_numel_and_trace():
    cfg = _cfg()
    assert [visit_numel(cfg, layer) for layer in range(4)] == [P_LAYER] * 4
    t = trace(_cfg(policy="looped"))
    assert [(k, v.layer) for k, v in t] == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("fwd", 1), ("fwd", 2), ("fwd", 3),
                                           ("bwd", 3), ("recompute", 2), ("bwd", 2), ("recompute", 1), ("bwd", 1),
                                           ("recompute", 2), ("bwd", 2), ("recompute", 1), ("bwd", 1), ("bwd", 0)]


@pytest.mark.parametrize("kw,want", [
    ({}, P_SPAN),                              # block order: the other layer of the block + the layer itself
    ({"order": "layer"}, P_LAYER),              # visits back to back: only the layer's own other modules
    ({"policy": "looped"}, 3 * P_LAYER),        # backward of layer 2: recompute + bwd of layer 1 in between
    ({"policy": "full"}, 3 * P_LAYER),
    ({"position": "none"}, 0),                  # nothing looped
])
def test_reuse_distance_needed_from_the_visit_plan(kw, want):
    assert reuse_distance_needed(_cfg(**kw)) == want


def test_auto_raises_values_never_lowers_and_user_values_win():
    big = 10 * 2 ** 30
    d = plan_zero3(_cfg(), dict(SMALL), 2, big, "fp32")
    assert d.applied and d.values == {"stage3_max_reuse_distance": P_SPAN, "stage3_prefetch_bucket_size": P_LAYER,
                                      "stage3_max_live_parameters": P_SPAN + 2 * P_LAYER}
    template = {k: 10 ** 9 for k in KEYS}
    assert plan_zero3(_cfg(), template, 2, big, "fp32").values == template  # DeepSpeed's 1e9 already covers it
    user = plan_zero3(_cfg(zero={"stage3_max_reuse_distance": 5}), dict(SMALL), 2, big, "fp32")
    assert user.values["stage3_max_reuse_distance"] == 5 and "user-set" in user.reason
    off = plan_zero3(_cfg(tuning="off"), dict(SMALL), 2, big, "fp32")
    assert not off.applied and off.values == SMALL
    assert not plan_zero3(_cfg(stage=2), dict(SMALL), 2, big, "fp32").applied


def test_auto_declines_when_the_block_does_not_fit():
    d = plan_zero3(_cfg(), dict(SMALL), 2, device_memory_bytes=2 ** 20, precision="fp32")  # 1 MiB GPU
    assert not d.applied and d.values == SMALL and "re-gathered" in d.reason
    assert d.extra_gathered_bytes == 4 * (P_SPAN + P_LAYER)  # fp32: 4 bytes per gathered element
    bf16 = plan_zero3(_cfg(), dict(SMALL), 2, device_memory_bytes=2 ** 20, precision="bf16")
    assert bf16.extra_gathered_bytes == 2 * (P_SPAN + P_LAYER)  # the planned precision, not this machine's


def test_build_ds_config_and_run_dir_file(tmp_path, monkeypatch):
    orig = zero_section_mod.load_template
    monkeypatch.setattr(zero_section_mod, "load_template", lambda name: _small_template(orig(name)))
    cfg = _cfg(zero={"stage3_param_persistence_threshold": 0})
    zero = build_ds_config(cfg, 2)["zero_optimization"]
    assert zero["stage3_max_reuse_distance"] == P_SPAN and zero["stage3_param_persistence_threshold"] == 0
    path = write_zero3_tuning(tmp_path, cfg, 2, build_ds_config(cfg, 2))
    data = json.loads(path.read_text())
    assert data["applied"] and data["final"]["stage3_max_reuse_distance"] == P_SPAN and data["reason"]
    off = zero_section(_cfg(tuning="off"), 2, 10 * 2 ** 30, "fp32")
    assert off["stage3_max_reuse_distance"] == 0  # `off`: the template's


def _small_template(t):
    """ds_configs/zero3.json with DeepSpeed's generic values scaled to the test model: below any
    reuse gap, as DeepSpeed's 1e9 elements are for a 54B model whose single visit holds more."""
    t["zero_optimization"].update(SMALL)
    return t


# ---------------------------------------------------------------------------------------------
# measured with DeepSpeed's comms logger (2 gloo ranks)
# ---------------------------------------------------------------------------------------------


def _gather_bytes() -> int:
    """All-gather bytes logged since the last call: sum over message sizes of count * size; the
    logged size of an all-gather is one rank's input, i.e. its partitions' bytes."""
    import deepspeed.comm as dcomm

    data = dcomm.comms_logger.get_raw_data()
    out = sum(count * size for op, sizes in data.items() if "gather" in op for size, (count, *_) in sizes.items())
    dcomm.comms_logger.reset_data()
    return out


def _comms_worker(rank, world, raws):
    from smelt_ds.train.build import build
    from smelt_ds.train.objective import total_loss

    orig = zero_section_mod.load_template
    zero_section_mod.load_template = lambda name: _small_template(orig(name))
    res = []
    for raw in raws:
        cfg = config_from_dict(raw)
        built = build(cfg, world)  # model, checkpointing and engine as training builds them
        eng, ds = built.engine, built.ds_config
        per_step = []
        for step in range(4):  # DeepSpeed records its trace in steps 1-2; step 3 on use it
            _gather_bytes()
            ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(10 * step + rank))
            out = eng(ids[:, :-1], labels=ids[:, 1:])
            fwd = _gather_bytes()
            eng.backward(total_loss(out, cfg.train))
            bwd = _gather_bytes()
            eng.step()
            per_step.append((fwd, bwd + _gather_bytes()))
        parts = {n: p.ds_tensor.ds_numel * p.element_size() for n, p in eng.module.named_parameters()}
        res.append({"steps": per_step, "parts": parts,
                    "zero": {k: ds["zero_optimization"][k] for k in KEYS}})
    return res


CASES = [("off", "none", True), ("auto", "none", True), ("auto", "none", False),
         ("off", "looped", True), ("auto", "looped", True)]


@pytest.fixture(scope="module")
@slow_fixture
def comms():
    raws = []
    for tuning, policy, no_prefetch in CASES:
        zero = {"stage3_param_persistence_threshold": 0}  # tiny params would otherwise never be released
        if no_prefetch:
            zero["stage3_prefetch_bucket_size"] = 0  # user value: exact counts without prefetch reordering
        raws.append(_raw(tuning=tuning, policy=policy, zero=zero, comms=True))
    return run_distributed(_comms_worker, 2, args=(raws,), timeout=240)[0]


def test_allgather_bytes_per_step_auto_vs_off(comms):
    """Expected all-gather bytes per step (steps 3-4, after DeepSpeed recorded its trace), from the
    visit plan and each parameter's partition bytes ``b(p)`` (``ds_tensor`` numel x 4 on 2 ranks):

    * ``off`` (reuse distance 0: every module use gathers): forward ``sum_visits b(layer) + b(embed,
      norm, head)`` = the looped layers twice; backward the same again, plus one more pass over the
      checkpointed visits for their recompute (``looped``: the 4 looped visits).
    * ``auto`` (reuse distance = what the plan needs): the forward gathers every parameter exactly
      once (``sum_p b(p)``): the looped block stays gathered for its second visit; the backward
      gathers every parameter at most once (its looped visits and recomputes share one gather;
      parameters used at the end of the forward may even stay gathered into the backward).

    So auto saves at least ``2 * b(looped block)`` per step, and more with checkpointing.
    """
    res = {case: r for case, r in zip(CASES, comms, strict=True)}
    parts = res[CASES[0]]["parts"]
    b_layer = {i: sum(v for n, v in parts.items() if n.startswith(f"layers.{i}.")) for i in range(4)}
    b_outside = sum(v for n, v in parts.items() if not n.startswith("layers."))
    b_all = sum(parts.values())
    plan = [0, 1, 2, 1, 2, 3]
    fwd_off = sum(b_layer[i] for i in plan) + b_outside
    assert b_layer[1] == b_layer[2] == 4 * P_LAYER // 2  # fp32, half of each layer per rank
    recompute = 2 * (b_layer[1] + b_layer[2])  # looped policy: the 4 looped visits once more
    expected = {("off", "none"): (fwd_off, fwd_off), ("off", "looped"): (fwd_off, fwd_off + recompute)}
    for (tuning, policy, no_prefetch), r in res.items():
        for fwd, bwd in r["steps"][2:]:
            if tuning == "off":
                assert (fwd, bwd) == expected[(tuning, policy)], (tuning, policy)
                continue
            if no_prefetch:
                assert fwd == b_all, (tuning, policy)
            assert bwd <= b_all, (tuning, policy)
            off_fwd, off_bwd = expected[("off", policy)]
            assert fwd + bwd <= off_fwd + off_bwd - 2 * (b_layer[1] + b_layer[2]), (tuning, policy)
    # the values DeepSpeed ran with
    assert res[("auto", "none", True)]["zero"] == {"stage3_max_reuse_distance": P_SPAN,
                                                   "stage3_max_live_parameters": P_SPAN + 2 * P_LAYER,
                                                   "stage3_prefetch_bucket_size": 0}
    assert res[("auto", "looped", True)]["zero"]["stage3_max_reuse_distance"] == 3 * P_LAYER
    assert res[("off", "none", True)]["zero"]["stage3_max_reuse_distance"] == 0
    # with the tuned prefetch too, auto moves far fewer bytes than off
    auto_pf = res[("auto", "none", False)]["steps"][3]
    assert sum(auto_pf) < sum(expected[("off", "none")]) - 2 * (b_layer[1] + b_layer[2])

