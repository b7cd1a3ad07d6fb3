"""Per-architecture Chinchilla scaling laws from finished runs, and the compute a looped model saves.

The study (docs/scaling.md; the SMELT paper's headline): fit a separate

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
(:class:`~smelt_ds.study.scaling.law.FlopsModel`; non-negative least squares on the relative error, one fit per
architecture, from the distinct sizes of its runs) and report its residuals. With
``f0 = fh = 0, f1 = 6`` this is Chinchilla's ``C = 6 N D``.

**Fit** (:func:`~smelt_ds.study.scaling.fit.fit_law`): Hoffmann et al. 2022 ("Training Compute-Optimal Large Language
Models", arXiv 2203.15556), Approach 3 / Appendix D.2: minimise the Huber loss (delta = 1e-3) of
``LSE(a - alpha log N, b - beta log D, e) - log L`` over ``(a, b, e, alpha, beta)`` with
``A = exp(a), B = exp(b), E = exp(e)``, by L-BFGS (scipy's L-BFGS-B) started from a grid of
initialisations (alpha, beta in {0, 0.5, ..., 2}, e in {-1, -0.5, ..., 1}, a, b in {0, 5, ..., 25}).
Deviation, for speed: the objective is evaluated on the whole 4500-point grid and L-BFGS runs
from the best ``n_starts`` grid points only. The Huber sum is divided by delta^2 and the
optimiser's tolerances are tight (Besiroglu et al. 2024, arXiv 2404.10102, traced Chinchilla's
odd Approach-3 estimates to a loose optimiser stop). Confidence intervals: nonparametric
bootstrap over runs (resampled with replacement within each architecture), percentile intervals.

**Frontier** (:func:`.frontier.frontier`): ``L*(C) = min_N L(N, C / f(N))``, with ``N_opt(C)`` and
``D_opt(C) = C / f(N_opt)`` (Chinchilla's compute-optimal allocation: minimise L subject to the
FLOPs constraint; closed form for ``C = k N D``: ``N_opt = G (C/k)^(beta/(alpha+beta))``,
``G = (alpha A / (beta B))^(1/(alpha+beta))``; here solved numerically because ``f0 > 0``).

**Savings** (:func:`.frontier.compute_savings`): at Baseline compute ``C`` on its frontier, the loss is
``l = L*_B(C)``; the other architecture reaches ``l`` at ``C_X = (L*_X)^-1(l)``. The training-FLOPs
saving is ``1 - C_X / C`` (positive: the architecture needs less compute for the same loss). The
loss difference at equal compute is ``L*_X(C) - L*_B(C)`` (nats/token).

**Envelope** (:func:`.frontier.envelope`): model-free cross-checks from the runs themselves: the lower
envelope of loss vs compute (Hoffmann's Approach 1 in spirit, on final losses only), and, where
the grid has several sizes at (about) the same compute, IsoFLOP parabolas in ``log N``
(Approach 2) giving ``N_opt`` at that compute.

The stages, one module each: :mod:`~smelt_ds.study.scaling.collect` (runs from run directories),
:mod:`~smelt_ds.study.scaling.law` (the law and the FLOPs model), :mod:`~smelt_ds.study.scaling.fit`
(Huber / L-BFGS fit, bootstrap), :mod:`~smelt_ds.study.scaling.frontier` (frontier, savings,
envelope, IsoFLOP profiles), :mod:`~smelt_ds.study.scaling.analysis` (every stage per
architecture, paired runs) and :mod:`~smelt_ds.study.scaling.report` (markdown, JSON, PNG).
"""

from smelt_ds.study.scaling.analysis import analyse
from smelt_ds.study.scaling.collect import collect_runs, summarize_exclusions
from smelt_ds.study.scaling.report import measured_savings, write_report

__all__ = ["analyse", "collect_runs", "summarize_exclusions", "measured_savings", "write_report"]
