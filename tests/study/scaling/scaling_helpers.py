"""Shared pieces of the scaling tests (tests/study/scaling/): a known law (Chinchilla's), a grid of
runs drawn from a law, the closed-form frontier of C = k N D, and fake run directories."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from smelt_ds.study.scaling.law import ScalingLaw

# Chinchilla's Approach-3 estimate (Hoffmann et al. 2022, Eq. 10) as the known law
CHINCHILLA = ScalingLaw(E=1.69, A=406.4, alpha=0.34, B=410.7, beta=0.28)


def law_grid(law, n_sizes=6, n_tokens=6, noise=0.0, seed=0):
    """``(N, D, L)`` of runs on a grid of sizes 1e7..1e10 and tokens 1e9..1e12 (``noise``: relative
    multiplicative noise on the loss)."""
    N, D = np.meshgrid(np.geomspace(1e7, 1e10, n_sizes), np.geomspace(1e9, 1e12, n_tokens))
    N, D = N.ravel(), D.ravel()
    L = law(N, D) * np.exp(np.random.default_rng(seed).normal(0, noise, N.shape)) if noise else law(N, D)
    return N, D, L


def closed_form(law, k, C):
    """Chinchilla's frontier for C = k N D: N_opt = G (C/k)^(b/(a+b)), L* = E + K (C/k)^(-ab/(a+b))."""
    a, b = law.alpha, law.beta
    G = (a * law.A / (b * law.B)) ** (1 / (a + b))
    K = law.A * G ** -a + law.B * G ** b
    Cp = np.asarray(C) / k
    return law.E + K * Cp ** (-a * b / (a + b)), G * Cp ** (b / (a + b)), K, a * b / (a + b)


def fake_run(root: Path, arch, position, n, d, loss, fpt, name=None) -> Path:
    """A run directory with ``sweep_run.json`` and (unless ``loss`` is None: unfinished) a
    ``summary.json`` of ``n`` parameters, ``d`` tokens, loss ``loss``, ``fpt`` FLOPs per token."""
    run = root / arch / (name or f"n{n:.0f}-d{d:.0f}")
    run.mkdir(parents=True)
    (run / "sweep_run.json").write_text(json.dumps({"architecture": arch, "position": position}))
    if loss is not None:
        (run / "summary.json").write_text(json.dumps({
            "steps": 1, "tokens": d, "validation_loss": {"all": loss},
            "budget": {"non_embedding_params": n, "train_flops_per_token": fpt}}))
    return run
