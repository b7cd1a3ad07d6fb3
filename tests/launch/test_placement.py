"""A recipe resolved for a cluster layout (smelt_ds.launch.placement): the layout's overrides apply
before the user's, an unknown layout is named with the recipe's layouts."""

from __future__ import annotations

import pytest

from smelt_ds.config.loading import load_config
from smelt_ds.errors import ConfigError
from smelt_ds.launch.placement import resolve


def test_layout_overrides_apply_before_user_overrides():
    r = resolve("recipes/xl/smelt.yaml", "h200")
    assert r.config.train.micro_batch_size == 2 and r.overrides == ["train.micro_batch_size=2"]
    r = resolve("recipes/xl/smelt.yaml", "h200", ["train.micro_batch_size=4"])
    assert r.config.train.micro_batch_size == 4  # --set wins over the layout
    assert resolve("recipes/xl/smelt.yaml").config.train.micro_batch_size == 1
    with pytest.raises(ConfigError, match=r"--layout 'a100'.*\['h100', 'h200'\]"):
        resolve("recipes/xl/smelt.yaml", "a100")
    with pytest.raises(ConfigError, match="cluster.default"):
        load_config("recipes/xl/smelt.yaml", ["cluster.default=b200"])
