"""Base class of every config section (kept apart so that sub-packages can declare their own
sections without importing the whole recipe tree)."""

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, assignment is validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
