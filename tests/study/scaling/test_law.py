"""The FLOPs model of the law (smelt_ds/study/scaling/law.py): its terms recovered, and real budgets of a
width family fitted."""

from __future__ import annotations

import numpy as np
import pytest

from smelt_ds.study.scaling.law import fit_flops_model


def test_flops_model_recovers_its_terms_and_reports_residuals():
    N = np.array([1e6, 2e6, 5e6, 9e6])
    fm = fit_flops_model(N, 3e6 + 2000.0 * np.sqrt(N) + 8.0 * N)
    assert (fm.f0, fm.fh, fm.f1) == pytest.approx((3e6, 2000.0, 8.0), rel=1e-6)
    assert fm.max_rel_residual < 1e-9
    two = fit_flops_model(N[:2], 3e6 + 8.0 * N[:2])  # two sizes: a line
    assert (two.f0, two.fh, two.f1) == pytest.approx((3e6, 0.0, 8.0), rel=1e-9)
    assert fit_flops_model(N[:1], [7e6]).f1 == pytest.approx(7.0)
    assert fit_flops_model(N, [1e7, 2e7, 1e7, 2e7]).max_rel_residual > 0.1


def test_flops_model_fits_real_budgets_of_a_width_family():
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.cost.budget import compute_budget

    cfgs = [config_from_dict({"model": {"hidden_size": h, "vocab_size": 4096, "max_seq_len": 128},
                              "moe": {"num_experts": 14, "top_k": 4, "expert_ffn_size": 3 * h // 4},
                              "loop": {"position": "none"}, "train": {"seq_len": 128}}) for h in (64, 96, 128, 160)]
    b = [compute_budget(c) for c in cfgs]
    fm = fit_flops_model([x.non_embedding_params for x in b], [x.train_flops_per_token for x in b])
    assert fm.max_rel_residual < 0.005  # the head's 6 H V FLOPs are the sqrt(N) term
