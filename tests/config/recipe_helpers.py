"""Helpers of the config tests: a recipe written to a file, a config that must be refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from smelt_ds.config.loading import config_from_dict
from smelt_ds.errors import ConfigError


def bad(raw: dict[str, Any]) -> str:
    """The message of the ConfigError that validating ``raw`` raises (fails the test when none)."""
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    return str(info.value)


def custom_ranges(*items: tuple[int, int, int]) -> dict[str, Any]:
    """A ``loop`` section of explicit ``(start, end, repeats)`` ranges."""
    return {"position": "custom", "ranges": [{"start": a, "end": b, "repeats": r} for a, b, r in items]}


def write(tmp_path: Path, raw: dict[str, Any]) -> Path:
    """``raw`` as ``tmp_path/recipe.yaml``."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path
