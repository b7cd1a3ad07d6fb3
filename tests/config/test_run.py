"""The recipe schema (smelt_ds/config/run.py and its sections): defaults, unknown keys, the checks of
the model and loop sections."""

from __future__ import annotations

import re

import pytest

from smelt_ds.config.loading import config_from_dict
from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError
from tests.config.recipe_helpers import bad, custom_ranges


def test_defaults_validate():
    cfg = config_from_dict({})
    assert cfg == RunConfig()
    assert cfg.loop.position == "middle" and cfg.loop.repeats == 2 and cfg.loop.order == "block"


def test_config_error_is_not_a_value_error():
    assert not issubclass(ConfigError, ValueError)


def test_unknown_keys_top_level_listed():
    msg = bad({"modle": {}, "foo": 1, "model": {"hidden_size": 32}})
    assert "unknown key `modle` at the top level: did you mean `model`?" in msg
    assert "unknown keys in `<top level>`: ['foo']" in msg
    assert "'model'" in msg and "'moe'" in msg  # allowed keys are listed


def test_unknown_keys_nested_listed():
    msg = bad({"model": {"hidden": 3, "layers": 2}, "moe": {"experts": 4}})
    assert "unknown key `hidden` in `model`: did you mean `hidden_size`?" in msg
    assert "unknown key `layers` in `model`: did you mean `num_layers`?" in msg
    assert "unknown key `experts` in `moe`: did you mean `num_experts`?" in msg


def test_unknown_key_in_a_list_item_names_the_item_and_its_allowed_keys():
    loop = custom_ranges((1, 3, 2))
    loop["ranges"][0]["times"] = 3
    msg = bad({"loop": loop})
    assert "unknown keys in `loop.ranges[0]`: ['times']" in msg
    assert "allowed keys: ['end', 'repeats', 'start']" in msg


def test_num_heads_must_divide_hidden_size():
    msg = bad({"model": {"hidden_size": 64, "num_heads": 6, "num_kv_heads": 2}})
    assert "`model.num_heads` (6)" in msg and "`model.hidden_size` (64)" in msg
    # an explicit head_dim lifts the constraint
    assert config_from_dict({"model": {"hidden_size": 64, "num_heads": 6, "num_kv_heads": 2,
                                       "head_dim": 16}}).model.resolved_head_dim == 16


def test_num_kv_heads_must_divide_num_heads():
    msg = bad({"model": {"num_heads": 4, "num_kv_heads": 3}})
    assert "`model.num_kv_heads` (3)" in msg and "`model.num_heads` (4)" in msg


def test_top_k_at_most_num_experts():
    msg = bad({"moe": {"num_experts": 4, "top_k": 5}})
    assert "`moe.top_k` (5)" in msg and "`moe.num_experts` (4)" in msg
    assert config_from_dict({"moe": {"num_experts": 4, "top_k": 4}}).moe.top_k == 4


@pytest.mark.parametrize("sizes,paths", [
    ({"hidden_size": 0}, ["`model.hidden_size` (0)"]),
    ({"vocab_size": -1}, ["`model.vocab_size` (-1)"]),
    ({"hidden_size": 0, "vocab_size": -1}, ["`model.hidden_size` (0)", "`model.vocab_size` (-1)"]),
    ({"num_layers": 0}, ["`model.num_layers` (0)"]),
    ({"num_heads": -4}, ["`model.num_heads` (-4)"]),
])
def test_non_positive_sizes(sizes, paths):
    msg = bad({"model": sizes})
    for p in paths:
        assert p in msg
    assert "greater than 0" in msg


def test_non_positive_moe_sizes():
    msg = bad({"moe": {"num_experts": 0, "expert_ffn_size": -8}})
    assert "`moe.num_experts` (0)" in msg and "`moe.expert_ffn_size` (-8)" in msg


@pytest.mark.parametrize("items,expect", [
    ([(2, 9, 2)], r"`loop.ranges\[0\]` \(\[2, 9\)\) is out of bounds .*`model.num_layers` \(8\)"),
    ([(-1, 2, 2)], r"`loop.ranges\[0\]` \(\[-1, 2\)\) is out of bounds"),
    ([(0, 4, 2), (3, 6, 2)], r"`loop.ranges\[1\]` \(\[3, 6\)\) overlaps `loop.ranges\[0\]` \(\[0, 4\)\)"),
    ([(3, 3, 2)], r"`loop.ranges\[0\]` \(\[3, 3\)\) is empty"),
    ([(5, 4, 2)], r"`loop.ranges\[0\]` \(\[5, 4\)\) is empty"),
    ([(0, 2, 2), (4, 6, 0)], r"`loop.ranges\[1\].repeats` \(0\) must be >= 1"),
    # the message names the range by its index in the recipe, not after sorting
    ([(6, 9, 2), (0, 2, 2)], r"`loop.ranges\[0\]` \(\[6, 9\)\) is out of bounds"),
    ([(4, 7, 2), (0, 5, 2)], r"`loop.ranges\[0\]` \(\[4, 7\)\) overlaps `loop.ranges\[1\]` \(\[0, 5\)\)"),
])
def test_bad_loop_ranges(items, expect):
    msg = bad({"model": {"num_layers": 8}, "loop": custom_ranges(*items)})
    assert re.search(expect, msg), msg


def test_custom_without_ranges_and_ranges_with_a_preset():
    assert "`loop.ranges` ([])" in bad({"loop": {"position": "custom", "ranges": []}})
    assert "`loop.ranges` (None)" in bad({"loop": {"position": "custom"}})
    msg = bad({"loop": {"position": "middle", "ranges": [{"start": 0, "end": 1, "repeats": 2}]}})
    assert "`loop.ranges`" in msg and "'middle'" in msg


def test_preset_repeats_below_one():
    assert "`loop.repeats` (0)" in bad({"loop": {"repeats": 0}})


@pytest.mark.parametrize("layers,position", [(1, "middle"), (1, "bottom"), (1, "top"), (3, "asymmetric")])
def test_preset_with_empty_range_for_depth(layers, position):
    msg = bad({"model": {"num_layers": layers, "first_k_dense": 0}, "loop": {"position": position}})
    assert f"`loop.position` ('{position}')" in msg and f"`model.num_layers` ({layers})" in msg


def test_preset_uniform_and_none_fine_at_depth_one():
    for position in ("uniform", "none"):
        assert config_from_dict({"model": {"num_layers": 1}, "loop": {"position": position}})


def test_layer_order_rejects_input_injection():
    msg = bad({"loop": {"order": "layer", "input_injection": "add"}})
    assert "`loop.input_injection` ('add')" in msg and "'block'" in msg


def test_literal_fields_reject_unknown_values():
    msg = bad({"moe": {"score_func": "relu"}, "loop": {"position": "center"}})
    assert "`moe.score_func` ('relu')" in msg and "`loop.position` ('center')" in msg
