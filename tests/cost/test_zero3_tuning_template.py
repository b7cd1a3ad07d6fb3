"""When ``deepspeed.zero3_loop_tuning: auto`` changes anything with the *shipped* ZeRO-3 template.

``ds_configs/zero3.json`` sets ``stage3_max_reuse_distance`` and ``stage3_max_live_parameters``
to 1e9 elements and ``stage3_prefetch_bucket_size`` to 5e7. ``auto`` only raises values (never
lowers them), so it changes the config only where the visit plan needs more:

* the reuse distance, which decides the all-gather volume, iff ``reuse_distance_needed(cfg)``
  (about the looped block's per-GPU parameter count) exceeds 1e9 elements;
* the live-parameter cap iff that plus two of the largest visit exceeds 1e9;
* the prefetch bucket iff the largest visit exceeds 5e7 elements (prefetch only: same volume);

and in each case only when the extra gathered bytes fit the GPU. Below those thresholds, ``off``
and ``auto`` give the same DeepSpeed config, hence the same all-gather bytes: the template's 1e9
already keeps the looped block gathered between visits. The saving ``tests/cost/test_zero3_tuning.py``
measures is against a template patched to 0 (a stand-in for a model whose block exceeds 1e9).
Of the shipped recipes the looped variants of m, l and xl are past the threshold; only xl ships
with ZeRO-3.

Test model as in ``tests/cost/test_zero3_tuning.py``: P_layer = 9408 elements, looped block 18816.
"""

from __future__ import annotations

import pytest
import torch

from smelt_ds.config.loading import config_from_dict, load_config
from smelt_ds.cost.zero3_tuning import KEYS, plan_zero3, reuse_distance_needed, visit_numel
from smelt_ds.parallel.ds_config import build_ds_config
from smelt_ds.parallel.zero_section import load_template
from smelt_ds.testing import run_distributed

P_LAYER, P_SPAN = 9408, 18816
GIB = 2 ** 30


def _raw(tuning: str, zero: dict | None = None, comms: bool = False) -> dict:
    return {"name": "z3t", "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4,
                                     "num_kv_heads": 2, "max_seq_len": 32},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16},
            "loop": {"position": "middle"},
            "train": {"seq_len": 16, "micro_batch_size": 2, "lr": 1e-2, "warmup_steps": 1, "max_steps": 10},
            "deepspeed": {"zero_stage": 3, "zero3_loop_tuning": tuning, "comms_logger": comms,
                          "config": {"zero_optimization": dict(zero or {})}}}


def _template_zero() -> dict:
    return dict(load_template("zero3")["zero_optimization"])


def test_shipped_template_values():
    """The numbers the thresholds below come from (a change to the template must revisit them)."""
    zero = _template_zero()
    assert {k: zero[k] for k in KEYS} == {"stage3_max_reuse_distance": 10 ** 9,
                                          "stage3_max_live_parameters": 10 ** 9,
                                          "stage3_prefetch_bucket_size": 5 * 10 ** 7}


def test_below_the_threshold_auto_builds_the_same_deepspeed_config_as_off():
    cfg_auto, cfg_off = config_from_dict(_raw("auto")), config_from_dict(_raw("off"))
    assert reuse_distance_needed(cfg_auto) == P_SPAN < _template_zero()["stage3_max_reuse_distance"]
    assert build_ds_config(cfg_auto, 2) == build_ds_config(cfg_off, 2)
    d = plan_zero3(cfg_auto, _template_zero(), 2, 80 * GIB, "bf16")
    assert d.applied and d.values == d.base and "already cover" in d.reason


@pytest.mark.parametrize("reuse,changes", [(P_SPAN, False), (P_SPAN - 1, True)])
def test_auto_changes_the_reuse_distance_exactly_above_the_templates(reuse, changes):
    """The threshold is the template's own value: a template reuse distance of exactly what the
    plan needs is kept; one element less is raised to the need (live and prefetch kept at 1e9 /
    5e7, which cover the test model)."""
    zero = {**_template_zero(), "stage3_max_reuse_distance": reuse}
    d = plan_zero3(config_from_dict(_raw("auto")), zero, 2, 80 * GIB, "bf16")
    assert d.values["stage3_max_reuse_distance"] == (P_SPAN if changes else reuse)
    assert (d.values != d.base) is changes
    assert d.values["stage3_max_live_parameters"] == 10 ** 9 and d.values["stage3_prefetch_bucket_size"] == 5 * 10 ** 7


@pytest.mark.parametrize("path,raised", [("recipes/xl/smelt.yaml", True), ("recipes/xl/baseline.yaml", False),
                                         ("recipes/l/smelt.yaml", True), ("recipes/m/smelt.yaml", True),
                                         ("recipes/s/smelt.yaml", False)])
def test_which_shipped_recipes_pass_the_threshold(path, raised):
    """At ZeRO-3 on their default layout (per-GPU element counts: experts / ep_size): the looped
    blocks of xl (3.6e9), l (2.2e9) and m (1.3e9) need more than the template's 1e9 and fit, s
    (6.7e8) stays below, a Baseline loops nothing. (s, m and l ship with ZeRO-2, where the tuning
    does not apply; set to 3 here.)"""
    cfg = load_config(path, ["deepspeed.zero_stage=3"])
    layout = cfg.cluster.layouts[cfg.cluster.default or next(iter(cfg.cluster.layouts))]
    world = layout.nodes * layout.gpus_per_node
    d = plan_zero3(cfg, _template_zero(), world, int(layout.device_memory_gib * GIB), "bf16")
    need = reuse_distance_needed(cfg)
    assert (need > 10 ** 9) is raised
    assert d.values["stage3_max_reuse_distance"] == (need if raised else 10 ** 9), d.reason
    if raised:
        assert d.applied and d.extra_gathered_bytes <= d.free_bytes
    # the prefetch bucket follows the largest visit wherever something is looped (> 5e7 for all of these)
    if need:
        assert d.values["stage3_prefetch_bucket_size"] == max(5 * 10 ** 7, max(visit_numel(cfg, i)
                                                                                 for i in range(cfg.model.num_layers)))


# ---------------------------------------------------------------------------------------------
# measured: shipped template, off vs auto, DeepSpeed's comms logger on 2 gloo ranks
# ---------------------------------------------------------------------------------------------


def _gather_bytes() -> int:
    """All-gather bytes logged since the last call (count x message size; a message is one rank's
    partition), then reset."""
    import deepspeed.comm as dcomm

    data = dcomm.comms_logger.get_raw_data()
    out = sum(count * size for op, sizes in data.items() if "gather" in op for size, (count, *_) in sizes.items())
    dcomm.comms_logger.reset_data()
    return out


def _worker(rank, world, raws):
    from smelt_ds.model import SmeltLM
    from smelt_ds.parallel import engine
    from smelt_ds.train.objective import total_loss

    res = []
    for raw in raws:
        cfg = config_from_dict(raw)
        torch.manual_seed(0)
        eng, _, _, ds = engine.initialize(cfg, SmeltLM(cfg.model, cfg.moe, cfg.loop), world)
        steps = []
        for step in range(4):  # DeepSpeed records its module trace in steps 1-2 and uses it from step 3
            _gather_bytes()
            ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(10 * step + rank))
            out = eng(ids[:, :-1], labels=ids[:, 1:])
            fwd = _gather_bytes()
            eng.backward(total_loss(out, cfg.train))
            eng.step()
            steps.append((fwd, _gather_bytes()))
        parts = sum(p.ds_tensor.ds_numel * p.element_size() for p in eng.module.parameters())
        res.append({"steps": steps, "parts": parts, "zero": {k: ds["zero_optimization"][k] for k in KEYS}})
    return res


@pytest.mark.slow
def test_shipped_template_off_and_auto_gather_the_same_bytes():
    """Shipped template with two user values that make the count exact on a tiny model: every
    parameter releasable (persistence threshold 0; the template's 1e5 keeps all of these gathered
    for good) and no prefetch. ``off`` and ``auto`` then run with the same values and gather the
    same bytes per step; each forward gathers every parameter exactly once (sum of partitions),
    the looped block included, and the backward gathers nothing: the whole model is within the
    template's reuse distance, so nothing is released between the visits or before backward."""
    zero = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}
    raws = [_raw(t, zero, comms=True) for t in ("off", "auto")]
    off, auto = run_distributed(_worker, 2, args=(raws,), timeout=240)[0]
    assert off["zero"] == auto["zero"] == {"stage3_max_reuse_distance": 10 ** 9,
                                           "stage3_max_live_parameters": 10 ** 9, "stage3_prefetch_bucket_size": 0}
    assert off["steps"][2:] == auto["steps"][2:]
    for fwd, bwd in off["steps"][2:]:
        assert (fwd, bwd) == (off["parts"], 0)
