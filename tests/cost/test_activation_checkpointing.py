"""Which visits each activation-checkpointing policy recomputes (``smelt_ds/cost/activation_checkpointing.py``)."""

from __future__ import annotations

from smelt_ds.config.loading import config_from_dict
from smelt_ds.cost.activation_checkpointing import checkpointed_visits
from smelt_ds.model import SmeltLM, Visit


def _raw(policy="none", **ac):
    return {"name": "ckpt", "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4,
                                      "num_kv_heads": 2, "max_seq_len": 32},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16}, "loop": {"position": "middle"},
            "train": {"seq_len": 16, "micro_batch_size": 2,
                      "activation_checkpointing": {"policy": policy, "every_n": 2, **ac}}}


def test_checkpointed_visits_per_policy():
    cfg = config_from_dict(_raw())
    model_plan = SmeltLM(cfg.model, cfg.moe, cfg.loop).schedule.plan  # middle of 4: 0 1 2 1 2 3
    assert [v.layer for v in model_plan] == [0, 1, 2, 1, 2, 3]
    want = {"none": set(), "full": set(model_plan),
            "looped": {Visit(1, 0), Visit(2, 0), Visit(1, 1), Visit(2, 1)},
            "every_n": {Visit(0, 0), Visit(2, 0), Visit(2, 1)}}
    for policy, visits in want.items():
        c = config_from_dict(_raw(policy))
        assert checkpointed_visits(c, SmeltLM(c.model, c.moe, c.loop).schedule) == visits, policy
    c = config_from_dict(_raw("every_n", every_n=3))
    assert checkpointed_visits(c, SmeltLM(c.model, c.moe, c.loop).schedule) == {Visit(0, 0), Visit(1, 1)}
