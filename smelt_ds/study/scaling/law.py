"""The scaling law ``L(N, D) = E + A / N^alpha + B / D^beta`` (:class:`ScalingLaw`) and the training
FLOPs per token as a function of N (:class:`FlopsModel`, fitted by :func:`fit_flops_model`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from smelt_ds.errors import ConfigError

__all__ = ["ScalingLaw", "PARAM_NAMES", "FlopsModel", "fit_flops_model"]

#: the law's parameters in the order reports list them
PARAM_NAMES = ("E", "A", "alpha", "B", "beta")


@dataclass(frozen=True)
class ScalingLaw:
    """``L(N, D) = E + A / N^alpha + B / D^beta`` (nats/token; N parameters, D tokens)."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def __call__(self, N, D):
        N, D = np.asarray(N, dtype=float), np.asarray(D, dtype=float)
        return self.E + self.A * N ** -self.alpha + self.B * D ** -self.beta

    @classmethod
    def from_theta(cls, theta) -> ScalingLaw:
        a, b, e, alpha, beta = (float(x) for x in theta)
        return cls(math.exp(e), math.exp(a), alpha, math.exp(b), beta)

    def theta(self) -> np.ndarray:
        return np.array([math.log(self.A), math.log(self.B), math.log(self.E), self.alpha, self.beta])

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class FlopsModel:
    """Training FLOPs per token as a function of non-embedding parameters N:
    ``f(N) = f0 + fh * sqrt(N) + f1 * N``.

    ``f1 N``: the matrix multiplies of the layers (active share of the experts, every visit);
    ``fh sqrt(N)``: terms linear in the width H when a size family scales its width (N ~ H^2): the
    output head ``6 H V`` and attention scores ``12 S H`` per layer visit; ``f0``: the rest.
    Chinchilla's ``C = 6 N D`` is ``FlopsModel(0, 6)``.
    """

    f0: float
    f1: float
    fh: float = 0.0
    max_rel_residual: float = 0.0

    def __call__(self, N):
        N = np.asarray(N, dtype=float)
        return self.f0 + self.fh * np.sqrt(N) + self.f1 * N


def fit_flops_model(N: Sequence[float], flops_per_token: Sequence[float]) -> FlopsModel:
    """Fit :class:`FlopsModel` (all coefficients >= 0) to the runs' training FLOPs per token by
    non-negative least squares on the relative error: ``f0 + fh sqrt(N) + f1 N`` with >= 3
    distinct sizes, ``f0 + f1 N`` with 2, ``f1 = f / N`` with one.

    Raises ConfigError for empty input.
    """
    from scipy.optimize import nnls

    pairs = sorted(set(zip((float(n) for n in N), (float(f) for f in flops_per_token), strict=True)))
    if not pairs:
        raise ConfigError("no runs to fit FLOPs per token to")
    n, f = np.array(pairs).T
    sizes = len(set(n))
    if sizes == 1:
        f0, fh, f1 = 0.0, 0.0, float(f.mean() / n[0])
    else:
        cols = [np.ones_like(n), n] + ([np.sqrt(n)] if sizes >= 3 else [])
        coef, _ = nnls(np.stack([c / f for c in cols], axis=1), np.ones_like(f))
        f0, f1, fh = float(coef[0]), float(coef[1]), float(coef[2]) if sizes >= 3 else 0.0
    model = FlopsModel(f0, f1, fh)
    resid = float(np.max(np.abs(model(n) / f - 1)))
    return FlopsModel(f0, f1, fh, resid)
