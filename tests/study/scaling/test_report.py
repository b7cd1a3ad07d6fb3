"""The scaling report (smelt_ds/study/scaling/report.py): every markdown section in order, and the
sections left out without a second architecture or figures."""

from __future__ import annotations

import numpy as np

from smelt_ds.study.scaling.analysis import analyse
from smelt_ds.study.scaling.collect import RunPoint
from smelt_ds.study.scaling.law import ScalingLaw
from smelt_ds.study.scaling.report import report_markdown
from tests.study.scaling.scaling_helpers import CHINCHILLA


def test_markdown_report_has_every_section_heading_in_order():
    smelt = ScalingLaw(CHINCHILLA.E, 0.9 * CHINCHILLA.A, CHINCHILLA.alpha, CHINCHILLA.B, CHINCHILLA.beta)
    pts = [RunPoint(f"{arch}/{i}-{j}", arch, float(law(n, d)), float(n), float(d), 6 * float(n), pos, f"s{i}", f"d{j}")
           for arch, pos, law in (("baseline", "none", CHINCHILLA), ("smelt", "middle", smelt))
           for i, n in enumerate(np.geomspace(1e7, 1e10, 3)) for j, d in enumerate(np.geomspace(1e9, 1e12, 3))]
    res = analyse(pts, n_bootstrap=0, n_starts=4)
    md = report_markdown(res, {"loss vs training FLOPs": "scaling_loss_vs_flops.png"})
    headings = [line for line in md.splitlines() if line.startswith("#")]
    assert headings == ["# Scaling laws per architecture", "## Runs", "## Fits", "## Identification",
                        "## Compute-optimal frontier",
                        "## Training FLOPs saved vs baseline",
                        "## Paired runs: each architecture vs baseline at the same size and budget (no fit)",
                        "## Envelope and IsoFLOP profiles", "## Figures"]
    assert md.endswith("![loss vs training FLOPs](scaling_loss_vs_flops.png)\n")
    # one architecture, no figures: the savings, paired and figure sections are left out, the rest stay in order
    md1 = report_markdown(analyse(pts[:9], n_bootstrap=0, n_starts=4), {})
    assert [line for line in md1.splitlines() if line.startswith("#")] == [
        "# Scaling laws per architecture", "## Runs", "## Fits", "## Identification", "## Compute-optimal frontier",
        "## Envelope and IsoFLOP profiles"]
