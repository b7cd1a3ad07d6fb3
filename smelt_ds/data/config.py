"""The ``data`` section of a recipe."""

from __future__ import annotations

from pydantic import Field

from smelt_ds.schema import StrictModel


class DataConfig(StrictModel):
    """Where training tokens come from. Placeholder: the data pipeline fills this in."""

    vocab_size: int = Field(512, gt=0, description="tokenizer vocabulary size (tokens)")
