"""Per-architecture Chinchilla scaling laws from finished runs, and the compute a looped model saves.

The study (DESIGN §1; the SMELT paper's headline): fit a separate

    L(N, D) = E + A / N^alpha + B / D^beta

per architecture (Baseline, SMELT, ablations), where

- ``L`` is the final validation loss (nats/token, the ``all`` domain by default),
- ``N`` the **non-embedding** parameters (all experts counted; token embedding and output head
  excluded), from the run's budget (:func:`smelt_ds.cost.budget.compute_budget`),
- ``D`` the training tokens the run saw,

and compare the architectures on their compute-optimal frontiers.

**Training compute.** ``C = f(N) * D`` FLOPs, where ``f(N)`` is the architecture's *training*
FLOPs per token (3 x forward, every visit of a looped layer counted, attention at ``train.seq_len``,
output head included) from the budget of each run. Across a sweep ``f`` is not ``6 N``: MoE layers
spend FLOPs on ``top_k`` of ``num_experts`` experts, and the output head and attention scores add
FLOPs that grow with the width, not with ``N``. We fit ``f(N) = f0 + fh sqrt(N) + f1 N``
(:class:`FlopsModel`; non-negative least squares on the relative error, one fit per
architecture, from the distinct sizes of its runs) and report its residuals. With
``f0 = fh = 0, f1 = 6`` this is Chinchilla's ``C = 6 N D``.

**Fit** (:func:`fit_law`): Hoffmann et al. 2022 ("Training Compute-Optimal Large Language
Models", arXiv 2203.15556), Approach 3 / Appendix D.2: minimise the Huber loss (delta = 1e-3) of
``LSE(a - alpha log N, b - beta log D, e) - log L`` over ``(a, b, e, alpha, beta)`` with
``A = exp(a), B = exp(b), E = exp(e)``, by L-BFGS (scipy's L-BFGS-B) started from a grid of
initialisations (alpha, beta in {0, 0.5, ..., 2}, e in {-1, -0.5, ..., 1}, a, b in {0, 5, ..., 25}).
Deviation, for speed: the objective is evaluated on the whole 4500-point grid and L-BFGS runs
from the best ``n_starts`` grid points only. The Huber sum is divided by delta^2 and the
optimiser's tolerances are tight (Besiroglu et al. 2024, arXiv 2404.10102, traced Chinchilla's
odd Approach-3 estimates to a loose optimiser stop). Confidence intervals: nonparametric
bootstrap over runs (resampled with replacement within each architecture), percentile intervals.

**Frontier** (:func:`frontier`): ``L*(C) = min_N L(N, C / f(N))``, with ``N_opt(C)`` and
``D_opt(C) = C / f(N_opt)`` (Chinchilla's compute-optimal allocation: minimise L subject to the
FLOPs constraint; closed form for ``C = k N D``: ``N_opt = G (C/k)^(beta/(alpha+beta))``,
``G = (alpha A / (beta B))^(1/(alpha+beta))``; here solved numerically because ``f0 > 0``).

**Savings** (:func:`compute_savings`): at Baseline compute ``C`` on its frontier, the loss is
``l = L*_B(C)``; the other architecture reaches ``l`` at ``C_X = (L*_X)^-1(l)``. The training-FLOPs
saving is ``1 - C_X / C`` (positive: the architecture needs less compute for the same loss). The
loss difference at equal compute is ``L*_X(C) - L*_B(C)`` (nats/token).

**Envelope** (:func:`envelope`): model-free cross-checks from the runs themselves: the lower
envelope of loss vs compute (Hoffmann's Approach 1 in spirit, on final losses only), and, where
the grid has several sizes at (about) the same compute, IsoFLOP parabolas in ``log N``
(Approach 2) giving ``N_opt`` at that compute.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from smelt_ds.errors import ConfigError

__all__ = ["RunPoint", "Exclusion", "collect_runs", "architecture_label", "summarize_exclusions", "ScalingLaw",
           "FlopsModel", "FitResult", "fit_law", "fit_flops_model", "frontier", "compute_optimal", "compute_for_loss",
           "compute_savings", "bootstrap", "envelope", "isoflop_profiles", "analyse", "measured_savings",
           "report_markdown", "plot_report", "write_report", "single_blas_thread", "HUBER_DELTA"]

HUBER_DELTA = 1e-3  # Hoffmann et al. 2022, Appendix D.2
# Hoffmann et al. 2022, Appendix D.2: the grid of initialisations of (alpha, beta, e, a, b)
GRID_ALPHA = np.arange(0.0, 2.01, 0.5)
GRID_BETA = np.arange(0.0, 2.01, 0.5)
GRID_E = np.arange(-1.0, 1.01, 0.5)
GRID_A = np.arange(0.0, 25.01, 5.0)
GRID_B = np.arange(0.0, 25.01, 5.0)
# box for L-BFGS-B on (a, b, e, alpha, beta); an estimate on a bound is flagged in the report
BOUNDS = ((-20.0, 80.0), (-20.0, 80.0), (-10.0, 5.0), (0.0, 5.0), (0.0, 5.0))
PARAM_NAMES = ("E", "A", "alpha", "B", "beta")


# ---------------------------------------------------------------------------------------------
# collecting runs
# ---------------------------------------------------------------------------------------------


@dataclass
class RunPoint:
    """One finished run. ``loss`` nats/token; ``N`` non-embedding parameters; ``D`` training
    tokens; ``flops_per_token`` training FLOPs per token (3 x forward, loops counted);
    ``C = flops_per_token * D`` training FLOPs."""

    run_dir: str
    architecture: str
    loss: float
    N: float
    D: float
    flops_per_token: float
    position: str = "none"
    size: str | None = None
    budget: str | None = None

    @property
    def C(self) -> float:
        return self.flops_per_token * self.D


@dataclass
class Exclusion:
    """A run (or architecture) left out of the analysis and why."""

    what: str
    reason: str


def architecture_label(loop: dict[str, Any]) -> str:
    """Architecture of a recipe's ``loop`` section: ``baseline`` for ``position: none``, else
    ``<position>x<repeats>`` (``custom``/explicit ranges: ``custom[start:end:repeats,...]``)."""
    pos = loop.get("position", "middle")
    if pos == "none":
        return "baseline"
    if loop.get("ranges"):
        rs = ",".join(f"{r['start']}:{r['end']}:{r['repeats']}" for r in loop["ranges"])
        return f"{pos}[{rs}]"
    return f"{pos}x{loop.get('repeats', 2)}"


def _is_run_dir(p: Path) -> bool:
    return any((p / n).is_file() for n in ("summary.json", "sweep_run.json", "config.yaml"))


def _find_run_dirs(path: Path) -> list[Path]:
    if _is_run_dir(path):
        return [path]
    found = sorted({m.parent for n in ("summary.json", "sweep_run.json") for m in path.rglob(n)
                    if "checkpoints" not in m.parts and "exports" not in m.parts})
    return [p for p in found if not any(q != p and q in p.parents for q in found)]


def _read_point(run_dir: Path, loss_key: str) -> RunPoint | Exclusion:
    import yaml

    label = json.loads((run_dir / "sweep_run.json").read_text()) if (run_dir / "sweep_run.json").is_file() else {}
    if not (run_dir / "summary.json").is_file():
        return Exclusion(str(run_dir), "unfinished: no summary.json (missing or interrupted run; "
                                       "`smelt-ds sweep` resumes it)")
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except json.JSONDecodeError as e:
        return Exclusion(str(run_dir), f"summary.json is not valid JSON ({e})")
    val = s.get("validation_loss") or {}
    if loss_key not in val:
        return Exclusion(str(run_dir), f"summary.json has no validation_loss[{loss_key!r}] "
                                       f"(domains: {sorted(val)})")
    loss = val[loss_key]
    if loss is None or not math.isfinite(loss) or loss <= 0:
        return Exclusion(str(run_dir), f"validation loss {loss!r} is not a finite positive number (diverged run?)")
    b = s.get("budget") or {}
    if not b.get("non_embedding_params") or not b.get("train_flops_per_token") or not s.get("tokens"):
        return Exclusion(str(run_dir), "summary.json lacks budget.non_embedding_params, "
                                       "budget.train_flops_per_token or tokens")
    loop: dict[str, Any] = {}
    if (run_dir / "config.yaml").is_file():
        loop = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("loop") or {}
    arch = label.get("architecture") or architecture_label(loop)
    return RunPoint(str(run_dir), arch, float(loss), float(b["non_embedding_params"]), float(s["tokens"]),
                    float(b["train_flops_per_token"]), position=label.get("position", loop.get("position", "none")),
                    size=label.get("size"), budget=label.get("budget"))


def collect_runs(paths: Sequence[str | Path], loss_key: str = "all") -> tuple[list[RunPoint], list[Exclusion]]:
    """Read runs from run directories or directories holding run directories (a sweep's
    ``output_dir``). Returns the usable runs and the runs left out with reasons (unfinished,
    non-finite loss, missing fields).

    Raises ConfigError for a path that does not exist or holds no run directory.
    """
    points: list[RunPoint] = []
    excluded: list[Exclusion] = []
    seen: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise ConfigError(f"run directory {str(path)!r} does not exist: pass run directories (with "
                              "summary.json) or a sweep's output_dir")
        dirs = _find_run_dirs(path)
        if not dirs:
            raise ConfigError(f"{str(path)!r} holds no run directory (no summary.json, sweep_run.json or "
                              "config.yaml below it): pass a run directory or a sweep's output_dir")
        for d in dirs:
            if d.resolve() in seen:
                continue
            seen.add(d.resolve())
            r = _read_point(d, loss_key)
            if isinstance(r, RunPoint):
                points.append(r)
            else:
                excluded.append(r)
    return points, excluded


def summarize_exclusions(excluded: list[Exclusion], examples: int = 2) -> list[str]:
    """One line per distinct reason: ``<count> x <reason> (e.g. <paths>)``."""
    by: dict[str, list[str]] = {}
    for e in excluded:
        by.setdefault(e.reason, []).append(e.what)
    return [f"{len(w)} x {r} (e.g. {', '.join(w[:examples])}{', ...' if len(w) > examples else ''})"
            if len(w) > 1 else f"{w[0]}: {r}" for r, w in by.items()]


# ---------------------------------------------------------------------------------------------
# the law and the FLOPs model
# ---------------------------------------------------------------------------------------------


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
    def from_theta(cls, theta) -> "ScalingLaw":
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

    pairs = sorted(set(zip((float(n) for n in N), (float(f) for f in flops_per_token))))
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


# ---------------------------------------------------------------------------------------------
# Huber / L-BFGS fit (Hoffmann et al. 2022, Appendix D.2)
# ---------------------------------------------------------------------------------------------


@dataclass
class FitResult:
    """A fitted law with its objective (sum of Huber losses / delta^2) and diagnostics."""

    law: ScalingLaw
    objective: float
    n_points: int
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
    at_bound = [name for name, v, (lo, hi) in zip(("log A", "log B", "log E", "alpha", "beta"), best.x, BOUNDS)
                if min(v - lo, hi - v) < 1e-6]
    return FitResult(ScalingLaw.from_theta(best.x), float(best.fun), len(L), at_bound, bool(best.success))


# ---------------------------------------------------------------------------------------------
# compute-optimal frontier and savings
# ---------------------------------------------------------------------------------------------

LOGN_RANGE = (math.log(1.0), math.log(1e30))  # search range of N on the frontier (parameters)
_GOLDEN = (math.sqrt(5) - 1) / 2


def _loss_at(law: ScalingLaw, fm: FlopsModel, x: np.ndarray, C: np.ndarray) -> np.ndarray:
    N = np.exp(x)
    return law(N, C / fm(N))


def _log_compute_at(law: ScalingLaw, fm: FlopsModel, x: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """log of the training FLOPs a model of ``e^x`` parameters needs to reach ``loss``: ``f(N) D``
    with ``D = (B / (loss - E - A N^-alpha))^(1/beta)``; +inf where that model cannot reach it."""
    N = np.exp(x)
    gap = loss - law.E - law.A * N ** -law.alpha
    with np.errstate(divide="ignore", invalid="ignore"):
        val = np.log(fm(N)) + (math.log(law.B) - np.log(gap)) / law.beta
    return np.where(gap > 0, val, np.inf)


def _min_over_logn(fun, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised ``min_x fun(x, target)`` over ``x = log N`` in :data:`LOGN_RANGE`: a 600-point grid,
    then golden-section search between the grid neighbours of the best point. Returns
    ``(x_min, f_min)``; NaN where the minimum is on the range's edge or nowhere finite."""
    xs = np.linspace(*LOGN_RANGE, 600)
    vals = fun(xs[None, :], target[:, None])
    i = np.argmin(vals, axis=1)
    bad = (i == 0) | (i == len(xs) - 1) | ~np.isfinite(vals[np.arange(len(i)), i])
    lo, hi = xs[np.clip(i - 1, 0, len(xs) - 1)], xs[np.clip(i + 1, 0, len(xs) - 1)]
    x1, x2 = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    f1, f2 = fun(x1, target), fun(x2, target)
    for _ in range(60):
        left = f1 < f2
        hi, lo = np.where(left, x2, hi), np.where(left, lo, x1)
        x1, x2 = np.where(left, hi - _GOLDEN * (hi - lo), x2), np.where(left, x1, lo + _GOLDEN * (hi - lo))
        f1, f2 = fun(x1, target), fun(x2, target)
    x = (lo + hi) / 2
    nan = np.where(bad, np.nan, 1.0)
    return x * nan, fun(x, target) * nan


def frontier(law: ScalingLaw, fm: FlopsModel, C) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compute-optimal frontier at training compute ``C`` (FLOPs; scalar or array).

    Returns ``(L*, N_opt, D_opt)``: ``L*(C) = min_N L(N, C / f(N))`` (nats/token), the
    minimising non-embedding parameters and ``D_opt = C / f(N_opt)`` tokens, found over ``log N``
    in :data:`LOGN_RANGE` (NaN when the optimum lies on its edge).
    """
    C = np.atleast_1d(np.asarray(C, dtype=float))
    if law.alpha <= 0 or law.beta <= 0:  # no trade-off between N and D: no optimum
        nan = np.full_like(C, np.nan)
        return nan, nan, nan
    x, L = _min_over_logn(lambda x, c: _loss_at(law, fm, x, c), C)
    N = np.exp(x)
    return L, N, C / fm(N)


def compute_optimal(law: ScalingLaw, fm: FlopsModel, C) -> dict[str, np.ndarray]:
    """``{"C", "loss", "N_opt", "D_opt", "tokens_per_param"}`` on the frontier (see :func:`frontier`)."""
    L, N, D = frontier(law, fm, C)
    return {"C": np.atleast_1d(np.asarray(C, dtype=float)), "loss": L, "N_opt": N, "D_opt": D,
            "tokens_per_param": D / N}


def compute_for_loss(law: ScalingLaw, fm: FlopsModel, loss) -> np.ndarray:
    """Least training FLOPs at which the architecture reaches ``loss`` (nats/token): the inverse of
    the frontier ``L*(C)``, solved directly as ``min_N f(N) D(N)`` with ``D(N)`` the tokens that
    bring ``L(N, D)`` down to ``loss``. NaN when the loss is not reachable (``loss <= E``)."""
    loss = np.atleast_1d(np.asarray(loss, dtype=float))
    if law.alpha <= 0 or law.beta <= 0:
        return np.full_like(loss, np.nan)
    _, logc = _min_over_logn(lambda x, l: _log_compute_at(law, fm, x, l), loss)
    return np.exp(logc)


def compute_savings(base: ScalingLaw, base_fm: FlopsModel, other: ScalingLaw, other_fm: FlopsModel,
                    C) -> dict[str, np.ndarray]:
    """Savings of ``other`` vs the Baseline ``base`` on their compute-optimal frontiers.

    At Baseline training compute ``C`` (FLOPs): ``loss = L*_B(C)``, ``C_other`` = the compute at
    which ``other`` reaches that loss, ``saving = 1 - C_other / C`` (fraction of training FLOPs
    saved at equal loss; negative = costs more), ``loss_delta = L*_other(C) - L*_B(C)`` (nats/token,
    at equal compute; negative = better).
    """
    C = np.atleast_1d(np.asarray(C, dtype=float))
    lb = frontier(base, base_fm, C)[0]
    Co = compute_for_loss(other, other_fm, lb)
    return {"C": C, "baseline_loss": lb, "C_other": Co, "saving": 1 - Co / C,
            "loss_delta": frontier(other, other_fm, C)[0] - lb}


# ---------------------------------------------------------------------------------------------
# bootstrap
# ---------------------------------------------------------------------------------------------


def _resample(rng: np.random.Generator, pts: list[RunPoint], tries: int = 50) -> list[RunPoint] | None:
    for _ in range(tries):
        idx = rng.integers(0, len(pts), len(pts))
        sample = [pts[i] for i in idx]
        if len({p.N for p in sample}) >= 2 and len({p.D for p in sample}) >= 2:
            return sample
    return None


def _fit_points(pts: list[RunPoint], **kw) -> FitResult:
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
            fit = _fit_points(sample, n_starts=n_starts, extra_starts=[fits[arch].law.theta()])
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


def _ci(samples: np.ndarray | None, level: float = 0.95) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    if samples is None or len(samples) == 0:
        return None, None
    q = (1 - level) / 2 * 100
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanpercentile(samples, q, axis=0), np.nanpercentile(samples, 100 - q, axis=0)


# ---------------------------------------------------------------------------------------------
# model-free cross-checks: envelope and IsoFLOP profiles
# ---------------------------------------------------------------------------------------------


def envelope(points: list[RunPoint]) -> list[RunPoint]:
    """Lower envelope of loss vs training compute: runs (sorted by C) whose loss is below that of
    every cheaper run (Hoffmann et al. 2022 Approach 1 in spirit, final losses only)."""
    out, best = [], math.inf
    for p in sorted(points, key=lambda p: (p.C, p.loss)):
        if p.loss < best:
            out.append(p)
            best = p.loss
    return out


def isoflop_profiles(points: list[RunPoint], rel_tol: float = 0.1, min_sizes: int = 3) -> list[dict[str, Any]]:
    """IsoFLOP profiles (Hoffmann et al. 2022, Approach 2): groups of runs whose training compute
    lies within ``rel_tol`` of the group's smallest, with ``min_sizes`` distinct N; a parabola of
    loss in ``log N`` gives ``N_opt`` at the group's (geometric-mean) compute when it opens upward
    and its vertex lies within the sizes run."""
    groups: list[list[RunPoint]] = []
    for p in sorted(points, key=lambda p: p.C):
        if groups and p.C <= groups[-1][0].C * (1 + rel_tol):
            groups[-1].append(p)
        else:
            groups.append([p])
    out = []
    for g in groups:
        if len({p.N for p in g}) < min_sizes:
            continue
        x, y = np.log([p.N for p in g]), np.array([p.loss for p in g])
        c2, c1, c0 = np.polyfit(x, y, 2)
        C = float(np.exp(np.mean(np.log([p.C for p in g]))))
        row = {"C": C, "runs": len(g), "N": sorted({p.N for p in g}), "N_opt": None, "loss_opt": None}
        if c2 > 0 and x.min() <= -c1 / (2 * c2) <= x.max():
            xv = -c1 / (2 * c2)
            row["N_opt"], row["loss_opt"] = float(np.exp(xv)), float(c0 + c1 * xv + c2 * xv * xv)
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------
# the whole analysis
# ---------------------------------------------------------------------------------------------


def _pick_baseline(by_arch: dict[str, list[RunPoint]], baseline: str | None) -> str | None:
    if baseline is not None:
        if baseline not in by_arch:
            raise ConfigError(f"--baseline {baseline!r} is not among the architectures found: {sorted(by_arch)}")
        return baseline
    if "baseline" in by_arch:
        return "baseline"
    unlooped = [a for a, pts in by_arch.items() if all(p.position == "none" for p in pts)]
    return unlooped[0] if len(unlooped) == 1 else None


def analyse(points: list[RunPoint], excluded: list[Exclusion] | None = None, baseline: str | None = None,
            n_bootstrap: int = 200, seed: int = 0, c_range: tuple[float, float] | None = None,
            n_c: int = 25, n_starts: int = 32) -> dict[str, Any]:
    """Fit every architecture, its frontier and its savings vs the Baseline, with bootstrap CIs.

    ``c_range``: training FLOPs range of the frontier/savings tables (default: from the cheapest
    run's compute to 100x the most expensive). Architectures without enough runs for a fit are
    reported as exclusions. Returns a JSON-serialisable dict (see :func:`write_report`).

    Raises ConfigError when no architecture can be fitted.
    """
    excluded = list(excluded or [])
    by_arch: dict[str, list[RunPoint]] = {}
    for p in points:
        by_arch.setdefault(p.architecture, []).append(p)
    fits: dict[str, FitResult] = {}
    fms: dict[str, FlopsModel] = {}
    for arch, pts in sorted(by_arch.items()):
        try:
            fits[arch] = _fit_points(pts, n_starts=n_starts)
            fms[arch] = fit_flops_model([p.N for p in pts], [p.flops_per_token for p in pts])
        except ConfigError as e:
            excluded.append(Exclusion(f"architecture {arch}", str(e)))
    if not fits:
        reasons = "; ".join(summarize_exclusions(excluded)) or "no finished runs"
        base = _pick_baseline(by_arch, baseline) if by_arch else None
        paired = {a: paired_comparison(by_arch[base], pts) for a, pts in by_arch.items() if base and a != base}
        so_far = "; ".join(f"{a} - {base}: {pr['n_pairs']} pair(s), mean loss delta {pr['mean_delta']:+.4f} "
                           "nats/token" for a, pr in paired.items() if pr)
        raise ConfigError(f"no architecture has enough finished runs for a scaling-law fit: {reasons}"
                          + (f". Paired runs so far (same size and budget, no fit): {so_far}" if so_far else ""))
    base = _pick_baseline({a: by_arch[a] for a in fits}, baseline)
    fitted = [p for a in fits for p in by_arch[a]]
    cmin, cmax = min(p.C for p in fitted), max(p.C for p in fitted)
    lo, hi = c_range or (cmin, cmax * 100)
    if not (0 < lo < hi):
        raise ConfigError(f"--c-range ({lo:g}, {hi:g}) must be two positive FLOPs counts, low < high")
    C_grid = np.geomspace(lo, hi, n_c)
    boot = bootstrap(by_arch, fits, fms, base, C_grid, n=n_bootstrap, seed=seed) if n_bootstrap else {}
    archs: dict[str, Any] = {}
    for arch, fit in fits.items():
        pts = by_arch[arch]
        b = boot.get(arch, {})
        plo, phi = _ci(b.get("params"))
        opt = compute_optimal(fit.law, fms[arch], C_grid)
        flo, fhi = _ci(b.get("frontier"))
        pred = fit.law([p.N for p in pts], [p.D for p in pts])
        archs[arch] = {
            "n_runs": len(pts), "params": fit.law.as_dict(), "objective": fit.objective,
            "at_bound": fit.at_bound, "converged": fit.converged,
            "params_ci95": ({n: [float(plo[i]), float(phi[i])] for i, n in enumerate(PARAM_NAMES)}
                            if plo is not None and phi is not None else None),
            "rmse_log_loss": float(np.sqrt(np.mean((np.log(pred) - np.log([p.loss for p in pts])) ** 2))),
            "flops_per_token": {"f0": fms[arch].f0, "fh": fms[arch].fh, "f1": fms[arch].f1,
                                "max_rel_residual": fms[arch].max_rel_residual},
            "frontier": {k: v.tolist() for k, v in opt.items()},
            "frontier_ci95": [flo.tolist(), fhi.tolist()] if flo is not None and fhi is not None else None,
            "bootstrap_samples": int(len(b.get("params", []))), "bootstrap_failed": int(b.get("failed", 0)),
            "envelope": [_point_dict(p) for p in envelope(pts)],
            "isoflop": isoflop_profiles(pts),
        }
        if arch != base and base is not None:
            s = compute_savings(fits[base].law, fms[base], fit.law, fms[arch], C_grid)
            slo, shi = _ci(b.get("saving"))
            dlo, dhi = _ci(b.get("loss_delta"))
            archs[arch]["savings"] = {k: v.tolist() for k, v in s.items()}
            archs[arch]["savings_ci95"] = [slo.tolist(), shi.tolist()] if slo is not None and shi is not None else None
            archs[arch]["loss_delta_ci95"] = ([dlo.tolist(), dhi.tolist()] if dlo is not None and dhi is not None
                                              else None)
            archs[arch]["envelope_savings"] = _envelope_savings(envelope(by_arch[base]), envelope(pts))
            archs[arch]["paired"] = paired_comparison(by_arch[base], pts)
    return {"law": "L(N, D) = E + A / N^alpha + B / D^beta",
            "units": {"loss": "nats/token (validation)", "N": "non-embedding parameters (embedding and output "
                      "head excluded, all experts counted)", "D": "training tokens",
                      "C": "training FLOPs = f(N) * D, f = training FLOPs/token from the budget (3x forward, "
                           "every visit counted)"},
            "method": {"huber_delta": HUBER_DELTA, "n_starts": n_starts, "n_bootstrap": n_bootstrap, "seed": seed,
                       "source": "Hoffmann et al. 2022 (arXiv 2203.15556) Approach 3, Appendix D.2"},
            "baseline": base, "C_measured": [cmin, cmax], "C_grid": C_grid.tolist(),
            "runs": [_point_dict(p) for p in points], "excluded": [asdict(e) for e in excluded],
            "architectures": archs}


def paired_comparison(base_pts: list[RunPoint], other_pts: list[RunPoint], rel_tol: float = 0.02
                      ) -> dict[str, Any] | None:
    """Loss differences of runs matched one to one, without any fit: a run of the other
    architecture pairs with the Baseline run of the same sweep size and budget (labels from
    ``sweep_run.json``), else with the Baseline run of the same tokens ``D`` whose ``N`` is within
    ``rel_tol``. In a budget-matched sweep each pair has equal N, D and training FLOPs (within the
    matcher's tolerance), so ``delta = loss_X - loss_Baseline`` (nats/token; negative: X better)
    compares the architectures at equal compute directly.

    Returns ``{"n_pairs", "mean_delta", "ci95" (paired t interval, scipy.stats.ttest_rel),
    "p_value" (two-sided), "wins" (pairs with delta < 0), "by_budget" ({budget: mean delta}),
    "pairs": [{"size", "budget", "N", "D", "C", "loss", "baseline_loss", "delta"}], "unpaired"}``,
    or None without pairs.
    """
    from scipy import stats

    pairs: list[dict[str, Any]] = []
    unpaired = 0
    for p in other_pts:
        if p.size is not None and p.budget is not None:
            match = [b for b in base_pts if b.size == p.size and b.budget == p.budget]
        else:
            match = [b for b in base_pts if b.D == p.D and abs(b.N - p.N) <= rel_tol * b.N]
        if len(match) != 1:
            unpaired += 1
            continue
        b = match[0]
        pairs.append({"size": p.size, "budget": p.budget, "N": p.N, "D": p.D, "C": p.C, "loss": p.loss,
                      "baseline_loss": b.loss, "delta": p.loss - b.loss})
    if not pairs:
        return None
    x = np.array([q["loss"] for q in pairs])
    y = np.array([q["baseline_loss"] for q in pairs])
    out: dict[str, Any] = {"n_pairs": len(pairs), "mean_delta": float(np.mean(x - y)), "ci95": None,
                           "p_value": None, "wins": int(np.sum(x < y)), "unpaired": unpaired, "pairs": pairs}
    if len(pairs) >= 2 and np.std(x - y) > 0:
        t = stats.ttest_rel(x, y)
        ci = t.confidence_interval(0.95)
        out["ci95"], out["p_value"] = [float(ci.low), float(ci.high)], float(t.pvalue)
    by_budget: dict[str, list[float]] = {}
    for q in pairs:
        by_budget.setdefault(q["budget"] or f"D={q['D']:.3g}", []).append(q["delta"])
    out["by_budget"] = {k: float(np.mean(v)) for k, v in by_budget.items()}
    return out


def _point_dict(p: RunPoint) -> dict[str, Any]:
    return {**asdict(p), "C": p.C}


def _envelope_savings(base_env: list[RunPoint], other_env: list[RunPoint]) -> list[dict[str, float]]:
    """At each Baseline envelope run's loss, the other architecture's envelope compute at that loss
    (log-log interpolation along its envelope; only inside its loss range)."""
    if len(other_env) < 2:
        return []
    lc = np.log([p.C for p in other_env])
    ll = np.array([p.loss for p in other_env])  # decreasing along the envelope
    out = []
    for p in base_env:
        if ll.min() <= p.loss <= ll.max():
            c = float(np.exp(np.interp(p.loss, ll[::-1], lc[::-1])))
            out.append({"C": p.C, "loss": p.loss, "C_other": c, "saving": 1 - c / p.C})
    return out


# ---------------------------------------------------------------------------------------------
# report: markdown, JSON, PNG
# ---------------------------------------------------------------------------------------------


def _g(x: float | None, fmt: str = ".3g") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _pct(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return "< -1000%" if x < -10 else f"{100 * x:+.1f}%"


def measured_savings(res: dict[str, Any], arch: str) -> tuple[float, float] | None:
    """(min, max) training-FLOPs saving of ``arch`` vs the Baseline over the compute range the
    runs measured (no extrapolation), from :func:`analyse`'s result; None if undefined."""
    a = res["architectures"].get(arch, {})
    if "savings" not in a:
        return None
    lo, hi = res["C_measured"]
    vals = [v for c, v in zip(res["C_grid"], a["savings"]["saving"])
            if lo <= c <= hi * 1.0001 and v is not None and math.isfinite(v)]
    return (min(vals), max(vals)) if vals else None


def _ci_str(ci, i, pct=False) -> str:
    if ci is None:
        return ""
    lo, hi = ci[0][i], ci[1][i]
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return " (CI n/a)"
    return f" [{_pct(lo)}, {_pct(hi)}]" if pct else f" [{_g(lo)}, {_g(hi)}]"


def _md_header(res: dict[str, Any]) -> list[str]:
    """Title, the law and method, and the units."""
    m, u = res["method"], res["units"]
    return ["# Scaling laws per architecture", "",
            f"Law: `{res['law']}`, fitted separately per architecture (Hoffmann et al. 2022, Approach 3, "
            f"Appendix D.2: Huber loss, delta = {m['huber_delta']:g}, on log loss; L-BFGS from the "
            f"best {m['n_starts']} points of their initialisation grid). 95% confidence intervals: "
            f"percentile bootstrap over runs ({m['n_bootstrap']} resamples, seed "
            f"{m['seed']}).", "",
            f"- loss: {u['loss']}", f"- N: {u['N']}", f"- D: {u['D']}",
            f"- C: {u['C']}; per architecture f(N) = f0 + fh sqrt(N) + f1 N, fitted to the runs' "
            "budgets (non-negative least squares on relative error; fh: head and attention-score FLOPs, which "
            "grow with the width)", ""]


def _md_runs(res: dict[str, Any]) -> list[str]:
    """## Runs: one row per run, then the runs left out."""
    lines = ["## Runs", "", "| architecture | size | budget | N | D (tokens) | C (FLOPs) | loss |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in sorted(res["runs"], key=lambda r: (r["architecture"], r["N"], r["D"])):
        lines.append(f"| {r['architecture']} | {r['size'] or ''} | {r['budget'] or ''} | {r['N']:.4g} | "
                     f"{r['D']:.4g} | {r['C']:.4g} | {r['loss']:.4f} |")
    if res["excluded"]:
        lines += ["", "Excluded:", ""] + [f"- `{e['what']}`: {e['reason']}" for e in res["excluded"]]
    return lines


def _fit_notes(res: dict[str, Any]) -> list[str]:
    """Warnings on the fits: few runs, estimates on a bound, a poor f(N), failed resamples."""
    notes = []
    for arch, a in res["architectures"].items():
        if a["n_runs"] < 10:
            notes.append(f"{arch}: {a['n_runs']} runs for 5 parameters: treat the fit as illustrative")
        if a["at_bound"]:
            notes.append(f"{arch}: estimate on the optimiser's bound for {', '.join(a['at_bound'])}")
        if a["flops_per_token"]["max_rel_residual"] > 0.02:
            notes.append(f"{arch}: f(N) misses a run's FLOPs/token by "
                         f"{a['flops_per_token']['max_rel_residual']:.1%}")
        if a["bootstrap_failed"]:
            notes.append(f"{arch}: {a['bootstrap_failed']} bootstrap resamples had < 2 distinct N or D")
    return notes


def _md_fits(res: dict[str, Any]) -> list[str]:
    """## Fits: the law's parameters with CIs and f(N) per architecture, then the notes."""
    lines = ["", "## Fits", "", "| architecture | runs | E | A | alpha | B | beta | RMSE log L | f0 | fh | f1 |",
             "|---|---:|---|---|---|---|---|---:|---:|---:|---:|"]
    for arch, a in res["architectures"].items():
        ci = a["params_ci95"]
        cells = [f"{_g(a['params'][n], '.4g')}" + (f" [{_g(ci[n][0])}, {_g(ci[n][1])}]" if ci else "")
                 for n in PARAM_NAMES]
        fp = a["flops_per_token"]
        lines.append(f"| {arch} | {a['n_runs']} | " + " | ".join(cells) + f" | {a['rmse_log_loss']:.4f} | "
                     f"{fp['f0']:.4g} | {fp['fh']:.4g} | {fp['f1']:.4g} |")
    notes = _fit_notes(res)
    if notes:
        lines += [""] + [f"- note: {n}" for n in notes]
    return lines


def _table_rows(C: list[float]) -> list[int]:
    """Indices of the (at most 7, evenly spread) compute levels shown in the tables."""
    return sorted(set(np.linspace(0, len(C) - 1, min(len(C), 7)).round().astype(int).tolist()))


def _md_frontier(res: dict[str, Any]) -> list[str]:
    """## Compute-optimal frontier: L*, N_opt, D_opt per architecture at a few compute levels."""
    C = res["C_grid"]
    lines = ["", "## Compute-optimal frontier", "",
             "L*(C) = min over N of L(N, C / f(N)); N_opt, D_opt its minimiser "
             f"(training FLOPs measured in the runs: {res['C_measured'][0]:.3g} to {res['C_measured'][1]:.3g}; "
             "beyond is extrapolation).", "",
             "| C (FLOPs) | " + " | ".join(f"{a}: L* [CI] | N_opt | D_opt" for a in res["architectures"]) + " |",
             "|---:|" + "---|---:|---:|" * len(res["architectures"])]
    for i in _table_rows(C):
        row = [f"{C[i]:.3g}"]
        for a in res["architectures"].values():
            f = a["frontier"]
            row += [_g(f["loss"][i], ".4f") + _ci_str(a["frontier_ci95"], i), _g(f["N_opt"][i]), _g(f["D_opt"][i])]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _md_savings(res: dict[str, Any]) -> list[str]:
    """## Training FLOPs saved vs the Baseline: per architecture, saving and loss delta on the
    frontier, and the envelope cross-check. Empty without a Baseline and another architecture."""
    base = res["baseline"]
    if base is None or len(res["architectures"]) < 2:
        return []
    C = res["C_grid"]
    lines = ["", f"## Training FLOPs saved vs {base}", "",
             f"saving(C) = 1 - C_X / C, where C_X is the compute at which architecture X's frontier reaches "
             f"{base}'s frontier loss L*_{base}(C) (positive: X needs less compute). Loss delta: "
             f"L*_X(C) - L*_{base}(C) at equal compute (nats/token).", ""]
    for arch, a in res["architectures"].items():
        if "savings" not in a:
            continue
        s = a["savings"]
        m = measured_savings(res, arch)
        rng = f"{_pct(m[0])} to {_pct(m[1])}" if m else "n/a"
        lines += [f"**{arch}**: saving over the measured compute range: {rng}.", "",
                  "| C (FLOPs) | saving [95% CI] | loss delta [95% CI] |", "|---:|---|---|"]
        for i in _table_rows(C):
            lines.append(f"| {C[i]:.3g} | {_pct(s['saving'][i])}{_ci_str(a['savings_ci95'], i, True)} | "
                         f"{_g(s['loss_delta'][i], '+.4f')}{_ci_str(a['loss_delta_ci95'], i)} |")
        if a["envelope_savings"]:
            es = ", ".join(f"{_pct(e['saving'])} at {e['C']:.3g}" for e in a["envelope_savings"])
            lines += ["", f"Envelope cross-check (runs only, no fit): {es}."]
        lines.append("")
    return lines


def _md_paired(res: dict[str, Any]) -> list[str]:
    """## Paired runs: the fit-free comparison of matched runs. Empty without pairs."""
    paired = [(arch, a["paired"]) for arch, a in res["architectures"].items() if a.get("paired")]
    if not paired:
        return []
    lines = [f"## Paired runs: each architecture vs {res['baseline']} at the same size and budget (no fit)", "",
             "delta = loss - loss of the matched Baseline run (nats/token; negative: better). In a "
             "budget-matched sweep the two runs of a pair have the same N, D and training FLOPs, so this "
             "compares the architectures at equal compute without a law. 95% CI and p: paired t-test "
             "(scipy.stats.ttest_rel) over pairs; one seed per run, so seed noise is inside the spread.", "",
             "| architecture | pairs | mean delta [95% CI] | p | better in | mean delta by budget |",
             "|---|---:|---|---:|---:|---|"]
    for arch, pr in paired:
        ci = f" [{pr['ci95'][0]:+.4f}, {pr['ci95'][1]:+.4f}]" if pr["ci95"] else ""
        pv = f"{pr['p_value']:.3g}" if pr["p_value"] is not None else "n/a"
        bb = ", ".join(f"{k} {v:+.4f}" for k, v in pr["by_budget"].items())
        lines.append(f"| {arch} | {pr['n_pairs']} | {pr['mean_delta']:+.4f}{ci} | {pv} | "
                     f"{pr['wins']}/{pr['n_pairs']} | {bb} |")
    lines.append("")
    return lines


def _md_envelope(res: dict[str, Any]) -> list[str]:
    """## Envelope and IsoFLOP profiles: the model-free cross-checks per architecture."""
    lines = ["## Envelope and IsoFLOP profiles", ""]
    for arch, a in res["architectures"].items():
        env = ", ".join(f"{e['loss']:.3f} at {e['C']:.3g} (N {e['N']:.3g})" for e in a["envelope"])
        lines.append(f"- {arch} lower envelope (loss at C): {env}")
        for g in a["isoflop"]:
            lines.append(f"  - IsoFLOP at {g['C']:.3g} FLOPs over {len(g['N'])} sizes: N_opt "
                         f"{_g(g['N_opt'])}" + ("" if g["N_opt"] else " (no interior minimum)"))
        if not a["isoflop"]:
            lines.append("  - no IsoFLOP profile: no compute level with >= 3 sizes (use `flops:` budgets in the sweep)")
    return lines


def _md_figures(figures: dict[str, str]) -> list[str]:
    """## Figures: links to the PNGs of :func:`plot_report`. Empty without figures."""
    if not figures:
        return []
    return ["", "## Figures", ""] + [f"![{k}]({v})" for k, v in figures.items()]


def report_markdown(res: dict[str, Any], figures: dict[str, str]) -> str:
    """The markdown report of :func:`analyse`'s result, one section after another."""
    sections = [_md_header(res), _md_runs(res), _md_fits(res), _md_frontier(res), _md_savings(res),
                _md_paired(res), _md_envelope(res), _md_figures(figures)]
    return "\n".join(line for lines in sections for line in lines) + "\n"


def _save(fig, ax, out_dir: Path, name: str, xlabel: str, ylabel: str, title: str) -> str:
    """Log-x axes labels, title and legend, then write ``out_dir/name`` and close the figure."""
    import matplotlib.pyplot as plt

    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / name)
    plt.close(fig)
    return name


def _plot_loss_vs_flops(res: dict[str, Any], out_dir: Path, name: str, colors: list[str]) -> str | None:
    """Runs and fitted frontiers L*(C) with their 95% bands, over the measured compute."""
    import matplotlib.pyplot as plt

    C = np.array(res["C_grid"])
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for k, (arch, a) in enumerate(res["architectures"].items()):
        col = colors[k % len(colors)]
        pts = [r for r in res["runs"] if r["architecture"] == arch]
        ax.scatter([r["C"] for r in pts], [r["loss"] for r in pts], color=col, s=22, label=f"{arch} runs")
        ax.plot(C, np.array(a["frontier"]["loss"], dtype=float), color=col, label=f"{arch} frontier L*(C)")
        if a["frontier_ci95"]:
            band = [np.array(b, dtype=float) for b in a["frontier_ci95"]]
            ax.fill_between(C, band[0], band[1],
                            color=col, alpha=0.15, lw=0)
    ax.axvspan(*res["C_measured"], color="0.9", zorder=0, label="measured compute")
    return _save(fig, ax, out_dir, name,
                 "training FLOPs C",
                 "validation loss (nats/token)",
                 "Loss vs training compute, with compute-optimal frontiers (95% bootstrap bands)")


def _plot_savings(res: dict[str, Any], out_dir: Path, name: str, colors: list[str]) -> str | None:
    """Training FLOPs saved vs the Baseline per architecture with 95% bands (clipped to the
    axes); None without an architecture that has savings."""
    import matplotlib.pyplot as plt

    others = {a: v for a, v in res["architectures"].items() if "savings" in v}
    if not others:
        return None
    C = np.array(res["C_grid"])
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    point = np.concatenate([100 * np.array(a["savings"]["saving"], dtype=float) for a in others.values()])
    point = point[np.isfinite(point)]
    lo_y = max(-100.0, min(-10.0, 1.5 * point.min() - 5 if point.size else -10.0))
    hi_y = min(100.0, max(10.0, 1.5 * point.max() + 5 if point.size else 10.0))
    for k, (arch, a) in enumerate(res["architectures"].items()):
        if arch not in others:
            continue
        col = colors[k % len(colors)]
        ax.plot(C, 100 * np.array(a["savings"]["saving"], dtype=float), color=col, label=arch)
        if a["savings_ci95"]:  # clipped to the axes: a bootstrap band can reach -1000s of %
            ax.fill_between(C, np.clip(100 * np.array(a["savings_ci95"][0], dtype=float), lo_y, hi_y),
                            np.clip(100 * np.array(a["savings_ci95"][1], dtype=float), lo_y, hi_y),
                            color=col, alpha=0.15, lw=0)
    ax.set_ylim(lo_y, hi_y)
    ax.axhline(0, color="k", lw=0.8)
    ax.axvspan(*res["C_measured"], color="0.9", zorder=0, label="measured compute")
    return _save(fig, ax, out_dir, name,
                 f"{res['baseline']} training FLOPs C",
                 f"training FLOPs saved vs {res['baseline']} (%)",
                 "Compute saved at equal loss on the frontier (95% bootstrap bands, clipped to the axes)")


def _plot_paired(res: dict[str, Any], out_dir: Path, name: str, colors: list[str]) -> str | None:
    """The paired loss differences of :func:`paired_comparison`, with their mean and 95% CI;
    None without pairs."""
    import matplotlib.pyplot as plt

    paired = {a: v["paired"] for a, v in res["architectures"].items() if v.get("paired")}
    if not paired:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for k, arch in enumerate(res["architectures"]):
        if arch not in paired:
            continue
        col, pr = colors[k % len(colors)], paired[arch]
        ax.scatter([q["C"] for q in pr["pairs"]], [q["delta"] for q in pr["pairs"]], color=col, s=22,
                   label=f"{arch} - {res['baseline']}, one pair per size and budget")
        ax.axhline(pr["mean_delta"], color=col, lw=1.2, label=f"{arch} mean {pr['mean_delta']:+.4f}")
        if pr["ci95"]:
            ax.axhspan(*pr["ci95"], color=col, alpha=0.15, lw=0, label=f"{arch} 95% CI (paired t)")
    ax.axhline(0, color="k", lw=0.8)
    return _save(fig, ax, out_dir, name,
                 "training FLOPs C of the pair",
                 "loss difference (nats/token)",
                 f"Matched runs: loss minus the {res['baseline']} run of the same N, D and FLOPs (no fit)")


def plot_report(res: dict[str, Any], out_dir: Path, prefix: str = "scaling_") -> dict[str, str]:
    """Write ``<prefix>loss_vs_flops.png`` (runs and fitted frontiers with 95% bands) and, with a
    Baseline and another architecture, ``<prefix>savings.png`` and ``<prefix>paired.png`` (the
    paired loss differences of :func:`paired_comparison`). Returns ``{title: file name}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    figures = (("loss vs training FLOPs", "loss_vs_flops.png", _plot_loss_vs_flops),
               ("training FLOPs saved", "savings.png", _plot_savings),
               ("paired loss differences", "paired.png", _plot_paired))
    figs = {}
    for title, suffix, plot in figures:
        name = plot(res, out_dir, f"{prefix}{suffix}", colors)
        if name is not None:
            figs[title] = name
    return figs


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return _jsonable(x.item())
    return x


def write_report(res: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.md``, ``scaling.json`` (NaN as null) and the PNG figures to ``out_dir``.
    Returns the written paths by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res = _jsonable(res)
    figs = plot_report(res, out)
    (out / "scaling.json").write_text(json.dumps(res, indent=1))
    (out / "report.md").write_text(report_markdown(res, figs))
    return {"report": out / "report.md", "json": out / "scaling.json", **{k: out / v for k, v in figs.items()}}
