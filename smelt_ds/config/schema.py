"""Base class of every config section (kept apart so that sub-packages can declare their own
sections without importing the whole recipe tree)."""

import types
import typing
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _is_number_type(annotation: Any) -> bool:
    """``int``, ``float`` or an optional/union of them (not ``bool``)."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return bool(args) and all(a in (int, float) for a in args)
    return False


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, assignment is validated, and a YAML
    boolean is not taken for a number (pydantic's lax mode would read ``true`` as 1)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and _is_number_type(cls.model_fields[cast(str, info.field_name)].annotation):
            raise ValueError("needs a number, got a boolean: write a number (YAML reads true/false/yes/no/on/off "
                             "as booleans)")
        return value
