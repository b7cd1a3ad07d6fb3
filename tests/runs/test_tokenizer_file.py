"""A tokenizer.json's loading errors (smelt_ds.runs.tokenizer_file)."""

from __future__ import annotations

import pytest

from smelt_ds.errors import ConfigError
from smelt_ds.runs.tokenizer_file import load_tokenizer


def test_tokenizer_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"`data.tokenizer.path` \('.*missing.json'\): no such tokenizer file"):
        load_tokenizer(tmp_path / "missing.json", "data.tokenizer.path")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not a tokenizers JSON file"):
        load_tokenizer(tmp_path / "bad.json")
