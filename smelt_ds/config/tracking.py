"""The ``tracking`` section of a recipe: experiment trackers beside TensorBoard.

TensorBoard (``RUN/tb/``) and ``metrics.jsonl`` are always written; ``tracking.trackers`` adds
Weights & Biases, MLflow and DeepSpeed's CSV monitor, each receiving every ``metrics.jsonl`` row
(rank 0 only) with the optimizer step as its x-axis (:mod:`smelt_ds.train.trackers`). Whether a
tracker's package is installed is checked before training starts, not here, so a recipe validates
on a machine without the package.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from smelt_ds.config.schema import StrictModel
from smelt_ds.errors import fail

__all__ = ["TRACKERS", "WandbSection", "MlflowSection", "TrackingConfig"]

#: the trackers a recipe may list
TRACKERS = ("wandb", "mlflow", "csv")


class WandbSection(StrictModel):
    """Weights & Biases (``wandb.init`` through DeepSpeed's ``WandbMonitor``). Its files go to
    ``RUN/trackers/wandb/``; the run id is kept in ``RUN/trackers/ids.json`` so a resume continues
    the same W&B run."""

    project: str = Field("smelt-ds", description="W&B project (a name)")
    entity: str | None = Field(None, description="W&B entity (team or user); default: the logged-in user's")
    group: str | None = Field(None, description="W&B run group (a name), e.g. one per sweep")
    name: str | None = Field(None, description="W&B run name; default: the recipe's `name`")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="online (needs `wandb login`), offline (files only; upload later with `wandb sync`) or "
                          "disabled; default: $WANDB_MODE, else online")


class MlflowSection(StrictModel):
    """MLflow (the ``mlflow`` client API: one MLflow run per training run, resumed by its id)."""

    tracking_uri: str | None = Field(
        None, description="MLflow tracking server or store, e.g. http://host:5000; default: $MLFLOW_TRACKING_URI, "
                          "else MLflow's own default")
    experiment: str = Field("smelt-ds", description="MLflow experiment name (created when missing)")
    run_name: str | None = Field(None, description="MLflow run name; default: the recipe's `name`")


class TrackingConfig(StrictModel):
    """Experiment trackers beside TensorBoard, all fed the rows of ``metrics.jsonl`` (per optimizer
    step) plus the resolved config and the three budgets at the start of the run."""

    trackers: list[Literal["wandb", "mlflow", "csv"]] = Field(
        default_factory=list, description="trackers to log to besides TensorBoard: wandb (pip install "
                                          "'smelt-ds[wandb]'), mlflow (pip install 'smelt-ds[mlflow]'), csv "
                                          "(DeepSpeed's CSV monitor: RUN/trackers/csv/, one file per metric)")
    wandb: WandbSection = Field(default_factory=WandbSection)
    mlflow: MlflowSection = Field(default_factory=MlflowSection)
    on_unreachable: Literal["error", "fallback"] = Field(
        "error", description="a tracker whose server does not answer at start (10 s), or W&B online without an API "
                             "key: error (refuse to start, naming it) or fallback (a warning; W&B logs offline into "
                             "RUN/trackers/wandb for `wandb sync`, MLflow is left out of the run; metrics.jsonl and "
                             "TensorBoard hold every metric either way)")

    @model_validator(mode="after")
    def _check(self) -> TrackingConfig:
        twice = sorted({t for t in self.trackers if self.trackers.count(t) > 1})
        if twice:
            fail("tracking.trackers", self.trackers, f"names {twice} more than once", "list each tracker once")
        return self
