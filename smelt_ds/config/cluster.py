"""The ``cluster`` section of a recipe: the hardware layouts it is sized for (read by ``smelt-ds
render-job``, ``smelt-ds recipes table`` and the memory verdicts; training never reads it)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from smelt_ds.config.schema import StrictModel
from smelt_ds.errors import ConfigError

__all__ = ["ClusterLayout", "ClusterConfig"]


class ClusterLayout(StrictModel):
    """One hardware layout a recipe is sized for: ``nodes x gpus_per_node`` GPUs of one type.

    Read by ``smelt-ds render-job``, ``smelt-ds recipes table`` and the memory verdicts; training
    itself never reads it. ``overrides`` are ``--set KEY=VALUE`` strings applied to the recipe on
    this layout (e.g. a larger ``train.micro_batch_size`` on GPUs with more memory).
    """

    gpu: str = Field(..., description="GPU model, e.g. 'H100-SXM5-80GB'; 'cpu' for CPU processes")
    device_memory_gib: float = Field(..., gt=0,
                                     description="usable memory per GPU in GiB (2**30 bytes), as "
                                                 "torch.cuda.get_device_properties reports it (e.g. 79.1 for an "
                                                 "H100 80GB); above 4096 is refused as a size in bytes")
    nodes: int = Field(1, gt=0, description="number of nodes")
    gpus_per_node: int = Field(8, gt=0, description="GPUs (ranks) per node")
    overrides: list[str] = Field(default_factory=list,
                                 description="`--set KEY=VALUE` overrides applied to the recipe on this layout")


    @field_validator("device_memory_gib")
    @classmethod
    def _in_gib_not_bytes(cls, value: float) -> float:
        if value > 4096:
            raise ValueError(f"{value:g} GiB per GPU is more than any GPU has: the field is in GiB, not bytes "
                             f"(that would be {value / 2 ** 30:.1f} GiB); write e.g. 79.1 for an H100 80GB")
        return value


class ClusterConfig(StrictModel):
    """Cluster layouts of a recipe, by name (e.g. ``h100``, ``h200``); ``default`` names the one used
    when none is chosen. Empty for CPU recipes."""

    default: str | None = Field(None, description="name of the default layout; default: the first one")
    layouts: dict[str, ClusterLayout] = Field(default_factory=dict, description="layouts by name")

    @model_validator(mode="after")
    def _check_default(self) -> ClusterConfig:
        if self.default is not None and self.default not in self.layouts:
            raise ConfigError(f"`cluster.default` ({self.default!r}) names no layout of `cluster.layouts` "
                              f"({sorted(self.layouts)}): use one of them or remove it")
        return self
