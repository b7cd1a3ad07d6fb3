"""The ``cluster`` section: layouts' device memory is in GiB, and a size in bytes is refused."""

from __future__ import annotations

import pytest

from smelt_ds.config.loading import config_from_dict
from smelt_ds.errors import ConfigError


def _layout(gib: float) -> dict:
    return {"cluster": {"layouts": {"mine": {"gpu": "H100", "device_memory_gib": gib}}}}


@pytest.mark.parametrize("gib", [79.1, 139.7, 4096])
def test_device_memory_in_gib_is_kept(gib):
    assert config_from_dict(_layout(gib)).cluster.layouts["mine"].device_memory_gib == gib


def test_device_memory_in_bytes_is_refused_naming_field_value_and_fix():
    with pytest.raises(ConfigError, match=r"(?s)`cluster.layouts.mine.device_memory_gib` \(85899345920\).*"
                                          r"in GiB, not bytes \(that would be 80.0 GiB\).*79.1 for an H100"):
        config_from_dict(_layout(80 * 2 ** 30))
