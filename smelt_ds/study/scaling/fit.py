"""Fitting the law per architecture (Hoffmann et al. 2022, Approach 3, Appendix D.2): the Huber loss of
``LSE(a - alpha log N, b - beta log D, e) - log L`` minimised by L-BFGS-B from the best points of
their initialisation grid (:func:`fit_law`), and the nonparametric bootstrap over runs that gives
the confidence intervals (:func:`bootstrap`)."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from smelt_ds.errors import ConfigError
from smelt_ds.study.scaling.collect import RunPoint
from smelt_ds.study.scaling.frontier import compute_savings, frontier
from smelt_ds.study.scaling.law import FlopsModel, ScalingLaw

__all__ = ["HUBER_DELTA", "BOUNDS", "FitResult", "fit_law", "fit_points", "single_blas_thread", "bootstrap",
           "percentile_interval"]

HUBER_DELTA = 1e-3  # Hoffmann et al. 2022, Appendix D.2
# Hoffmann et al. 2022, Appendix D.2: the grid of initialisations of (alpha, beta, e, a, b)
GRID_ALPHA = np.arange(0.0, 2.01, 0.5)
GRID_BETA = np.arange(0.0, 2.01, 0.5)
GRID_E = np.arange(-1.0, 1.01, 0.5)
GRID_A = np.arange(0.0, 25.01, 5.0)
GRID_B = np.arange(0.0, 25.01, 5.0)
# box for L-BFGS-B on (a, b, e, alpha, beta); an estimate on a bound is flagged in the report
BOUNDS = ((-20.0, 80.0), (-20.0, 80.0), (-10.0, 5.0), (0.0, 5.0), (0.0, 5.0))


@dataclass
class FitResult:
    """A fitted law with its objective (sum of Huber losses / delta^2) and diagnostics."""

    law: ScalingLaw
    objective: float
    at_bound: list[str] = field(default_factory=list)
    converged: bool = True


def _huber(r: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    a = np.abs(r)
    val = np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))
    return val, np.clip(r, -delta, delta)


def _terms(theta: np.ndarray, logN: np.ndarray, logD: np.ndarray) -> np.ndarray:
    """shape: (..., n, 3): a - alpha log N, b - beta log D, e for theta of shape (..., 5)."""
    a, b, e, alpha, beta = (theta[..., i, None] for i in range(5))
    return np.stack([a - alpha * logN, b - beta * logD, np.broadcast_to(e, (a - alpha * logN).shape)], axis=-1)


def _objective(theta, logN, logD, logL, delta):
    t = _terms(np.asarray(theta), logN, logD)
    m = t.max(axis=-1, keepdims=True)
    ex = np.exp(t - m)
    s = ex.sum(axis=-1, keepdims=True)
    lse = (m + np.log(s))[..., 0]
    val, dval = _huber(lse - logL, delta)
    w = ex / s  # d lse / d term
    scale = delta * delta
    g = np.stack([(dval * w[..., 0]).sum(-1), (dval * w[..., 1]).sum(-1), (dval * w[..., 2]).sum(-1),
                  -(dval * w[..., 0] * logN).sum(-1), -(dval * w[..., 1] * logD).sum(-1)], axis=-1)
    return val.sum(-1) / scale, g / scale


def _objective_one(theta, logN, logD, logL, delta):
    """:func:`_objective` for one theta (what L-BFGS calls; a few array operations less)."""
    a, b, e, alpha, beta = theta
    t1, t2 = a - alpha * logN, b - beta * logD
    m = np.maximum(np.maximum(t1, t2), e)
    x1, x2, x3 = np.exp(t1 - m), np.exp(t2 - m), np.exp(e - m)
    s = x1 + x2 + x3
    r = m + np.log(s) - logL
    ar = np.abs(r)
    inside = ar <= delta
    val = np.where(inside, 0.5 * r * r, delta * (ar - 0.5 * delta)).sum()
    d = np.clip(r, -delta, delta) / s
    g1, g2 = d * x1, d * x2
    scale = delta * delta
    return val / scale, np.array([g1.sum(), g2.sum(), (d * x3).sum(), -(g1 @ logN), -(g2 @ logD)]) / scale


def _grid() -> np.ndarray:
    # Hoffmann's grid, in our theta order (a, b, e, alpha, beta)
    return np.array(list(itertools.product(GRID_A, GRID_B, GRID_E, GRID_ALPHA, GRID_BETA)))


_GRID = _grid()


@contextlib.contextmanager
def single_blas_thread():
    """Run the block with OpenBLAS (numpy's and scipy's bundled copies) on one thread.

    L-BFGS-B makes many tiny BLAS calls; on a loaded machine OpenBLAS's thread pool makes each
    fit several times slower. Linux only (reads /proc/self/maps); elsewhere a no-op.
    """
    restore = []
    try:
        libs = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if "openblas" in line and line.split()[-1].startswith("/")}
    except OSError:
        libs = set()
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for suffix in ("64_", "", "_64_", "_"):
            setter = getattr(lib, f"scipy_openblas_set_num_threads{suffix}", None) or \
                getattr(lib, f"openblas_set_num_threads{suffix}", None)
            getter = getattr(lib, f"scipy_openblas_get_num_threads{suffix}", None) or \
                getattr(lib, f"openblas_get_num_threads{suffix}", None)
            if setter is not None and getter is not None:
                restore.append((setter, int(getter())))
                setter(1)
                break
    try:
        yield
    finally:
        for setter, n in restore:
            setter(n)


def fit_law(N: Sequence[float] | np.ndarray, D: Sequence[float] | np.ndarray, L: Sequence[float] | np.ndarray,
            delta: float = HUBER_DELTA,
            n_starts: int = 32, extra_starts: Sequence[np.ndarray] = ()) -> FitResult:
    """Fit ``L(N, D) = E + A/N^alpha + B/D^beta`` (Hoffmann et al. 2022, App. D.2).

    ``N`` non-embedding parameters, ``D`` training tokens, ``L`` loss (nats/token). Minimises
    ``sum Huber_delta(LSE(a - alpha log N, b - beta log D, e) - log L) / delta^2`` by L-BFGS-B
    from the ``n_starts`` best points of the 4500-point initialisation grid plus
    ``extra_starts`` (theta vectors ``(a, b, e, alpha, beta)``); the lowest objective wins.

    Raises ConfigError for fewer than 4 runs, fewer than 2 distinct N or D, or non-positive input.
    """
    from scipy.optimize import minimize

    N, D, L = (np.asarray(x, dtype=float) for x in (N, D, L))
    if len(L) < 4 or len(set(N)) < 2 or len(set(D)) < 2:
        raise ConfigError(f"a fit of L(N, D) needs >= 4 runs spanning >= 2 distinct sizes N and >= 2 distinct "
                          f"token counts D; got {len(L)} run(s), {len(set(N))} size(s), {len(set(D))} token "
                          "count(s): add sizes or token budgets to the sweep")
    if not (np.all(N > 0) and np.all(D > 0) and np.all(L > 0) and np.all(np.isfinite(L))):
        raise ConfigError("N, D and loss must all be finite and positive")
    logN, logD, logL = np.log(N), np.log(D), np.log(L)
    grid_obj, _ = _objective(_GRID, logN, logD, logL, delta)
    starts = list(_GRID[np.argsort(grid_obj, kind="stable")[:n_starts]]) + [np.asarray(s) for s in extra_starts]
    best = None
    with single_blas_thread():
        for x0 in starts:
            x0 = np.clip(x0, [b[0] for b in BOUNDS], [b[1] for b in BOUNDS])
            res = minimize(_objective_one, x0, args=(logN, logD, logL, delta), jac=True, method="L-BFGS-B",
                           bounds=BOUNDS, options={"maxiter": 5000, "ftol": 1e-12, "gtol": 1e-8, "maxcor": 20})
            if best is None or res.fun < best.fun:
                best = res
    if best is None:
        raise ValueError(f"fit_law needs at least one start: got n_starts={n_starts} and no extra_starts")
    names = ("log A", "log B", "log E", "alpha", "beta")
    at_bound = [name for name, v, (lo, hi) in zip(names, best.x, BOUNDS, strict=True)
                if min(v - lo, hi - v) < 1e-6]
    return FitResult(ScalingLaw.from_theta(best.x), float(best.fun), at_bound, bool(best.success))


def _resample(rng: np.random.Generator, pts: list[RunPoint], tries: int = 50) -> list[RunPoint] | None:
    for _ in range(tries):
        idx = rng.integers(0, len(pts), len(pts))
        sample = [pts[i] for i in idx]
        if len({p.N for p in sample}) >= 2 and len({p.D for p in sample}) >= 2:
            return sample
    return None


def fit_points(pts: list[RunPoint], **kw) -> FitResult:
    """:func:`fit_law` of the runs ``pts`` (``kw`` passed on)."""
    return fit_law([p.N for p in pts], [p.D for p in pts], [p.loss for p in pts], **kw)


def bootstrap(by_arch: dict[str, list[RunPoint]], fits: dict[str, FitResult], fms: dict[str, FlopsModel],
              baseline: str | None, C_grid: np.ndarray, n: int = 200, seed: int = 0,
              n_starts: int = 2) -> dict[str, Any]:
    """Nonparametric bootstrap over runs: ``n`` times, resample each architecture's runs with
    replacement (redrawing samples with fewer than 2 distinct N or D), refit (starting from the
    full-data fit and the best ``n_starts`` grid points), and recompute the frontier and savings on
    ``C_grid``. Returns per architecture the arrays of parameters, frontier losses, savings and
    loss deltas (rows = successful resamples) and the count of failed resamples."""
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {a: {"params": [], "frontier": [], "saving": [], "loss_delta": [], "failed": 0}
                           for a in fits}
    for _ in range(n):
        laws = {}
        for arch, pts in by_arch.items():
            if arch not in fits:
                continue
            sample = _resample(rng, pts)
            if sample is None:
                out[arch]["failed"] += 1
                continue
            fit = fit_points(sample, n_starts=n_starts, extra_starts=[fits[arch].law.theta()])
            laws[arch] = fit.law
            law = fit.law
            out[arch]["params"].append([law.E, law.A, law.alpha, law.B, law.beta])
            out[arch]["frontier"].append(frontier(law, fms[arch], C_grid)[0])
        if baseline in laws:
            for arch, law in laws.items():
                if arch == baseline:
                    continue
                s = compute_savings(laws[baseline], fms[baseline], law, fms[arch], C_grid)
                out[arch]["saving"].append(s["saving"])
                out[arch]["loss_delta"].append(s["loss_delta"])
    return {a: {k: (np.array(v) if isinstance(v, list) else v) for k, v in d.items()} for a, d in out.items()}


def percentile_interval(samples: np.ndarray | None, level: float = 0.95
                        ) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """The ``level`` percentile interval of bootstrap ``samples`` (rows), per column, NaNs ignored:
    ``(low, high)``, or ``(None, None)`` without samples."""
    if samples is None or len(samples) == 0:
        return None, None
    q = (1 - level) / 2 * 100
    with np.errstate(all="ignore"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanpercentile(samples, q, axis=0), np.nanpercentile(samples, 100 - q, axis=0)
