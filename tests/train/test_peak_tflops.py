"""The MFU peak table (issue 45, item 5): a device's dense bf16 peak is found by the exact name
``torch.cuda.get_device_name()`` returns, so an H100 PCIe or NVL no longer gets the H100 SXM's
989.4 TFLOP/s by substring; an unknown name has no peak (no MFU). Cluster layouts (free-text
``gpu`` names such as 'H100-SXM5-80GB') must name the form factor where a family's parts differ.

The expected values are the datasheet numbers written out here (dense = half the "with sparsity"
figures), independently of the table in smelt_ds/train/metrics.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from smelt_ds.study import sweep_estimates
from smelt_ds.train import metrics
from smelt_ds.train.metrics import DEVICE_PEAK_TFLOPS, PEAK_TFLOPS, device_peak_tflops, layout_peak_tflops, peak_tflops

# torch.cuda.get_device_name() -> dense bf16 TFLOP/s per GPU
EXPECTED = {
    "NVIDIA H100 80GB HBM3": 989.4,  # H100 SXM5 (whitepaper: 989.4 dense / 1978.9 sparse)
    "NVIDIA H100 PCIe": 756.0,  # whitepaper: 756 / 1513
    "NVIDIA H100 NVL": 1671 / 2,  # datasheet: 1,671 per GPU with sparsity
    "NVIDIA H200": 989.4,  # H200 SXM: the H100 SXM's compute (datasheet 1,979 with sparsity)
    "NVIDIA H200 NVL": 1671 / 2,  # datasheet: 1,671 with sparsity
    "NVIDIA A100-SXM4-40GB": 312.0,  # A100 datasheet: 312 (624 with sparsity), every form factor
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA B200": 4500 / 2,  # HGX B200: 4.5 PFLOPS FP16/BF16 per GPU with sparsity
}

# names that must not get a peak: other GPUs, and near misses that a substring match would take
UNKNOWN = ["NVIDIA H800", "NVIDIA H100", "NVIDIA H100 80GB HBM3e", "NVIDIA GH200 480GB", "NVIDIA H20",
           "Tesla V100-SXM2-16GB", "Tesla T4", "NVIDIA A10", "NVIDIA A100X", "NVIDIA GeForce RTX 4090",
           "NVIDIA B200A", "NVIDIA H200 NVL2", "nvidia h100 pcie", "H100", "", "cpu"]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_peak_of_every_listed_device_name(name):
    assert peak_tflops(name) == pytest.approx(EXPECTED[name], rel=0, abs=1e-9)
    assert peak_tflops(f" {name}\n") == peak_tflops(name)  # blanks around the name do not matter


def test_table_lists_exactly_these_names():
    assert set(DEVICE_PEAK_TFLOPS) == set(EXPECTED)
    # the family table kept for layouts and bench/gpu_check.py: each family's SXM part
    assert PEAK_TFLOPS == {"H100": 989.4, "H200": 989.4, "A100": 312.0, "B200": 2250.0}


@pytest.mark.parametrize("name", UNKNOWN)
def test_unknown_names_have_no_peak(name):
    assert peak_tflops(name) is None


@pytest.mark.parametrize("name,want", [("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.5),
                                       ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H800", None)])
def test_device_peak_reads_the_current_device_name(monkeypatch, name, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_tflops() == want
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_peak_tflops() is None


@pytest.mark.parametrize("gpu,want", [
    ("H100-SXM5-80GB", 989.4), ("H200-SXM-141GB", 989.4), ("h100 sxm", 989.4), ("H100-PCIe-80GB", 756.0),
    ("H100_NVL_94GB", 835.5), ("H200-NVL", 835.5), ("A100-SXM4-80GB", 312.0), ("A100-80GB", 312.0),
    ("A100-PCIe-40GB", 312.0), ("B200", 2250.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.4),
    # no form factor where a family's parts differ, two of them, two families, other GPUs: no peak
    ("H100", None), ("H200-141GB", None), ("H100-SXM5-PCIe", None), ("H100/A100-SXM", None),
    ("GH100-SXM", None), ("V100-SXM2-32GB", None), ("H800-SXM5", None), ("cpu", None),
    ("B200-PCIe", None), ("H200-PCIe", None),
])
def test_layout_gpu_names(gpu, want):
    assert layout_peak_tflops(gpu) == want


def _plan_with_layout(gpu: str):
    layout = SimpleNamespace(gpu=gpu, nodes=2, gpus_per_node=4)
    cluster = SimpleNamespace(layouts={"l": layout}, default="l")
    plan = SimpleNamespace(sweep=SimpleNamespace(launch=SimpleNamespace(layout=None)))
    return plan, SimpleNamespace(config=SimpleNamespace(cluster=cluster))


def test_sweep_estimate_of_a_pcie_layout_uses_the_pcie_peak():
    """An analytic sweep estimate for 8 H100 PCIe GPUs: 8 x 756e12 x MFU FLOP/s (the SXM's 989.4
    before); an unnamed form factor gives no estimate and says what is known."""
    plan, run = _plan_with_layout("H100-PCIe-80GB")
    flops, gpus, source = sweep_estimates._analytic(plan, run, 1, 2, None, 0.3)
    assert gpus == 8 and flops == pytest.approx(8 * 756e12 * 0.3, rel=1e-15)
    assert "at 756 TFLOP/s" in source
    plan, run = _plan_with_layout("H100")
    flops, gpus, source = sweep_estimates._analytic(plan, run, 1, 2, None, 0.3)
    assert flops is None and gpus == 8 and "no peak TFLOP/s known for GPU 'H100'" in source
    assert "H100 PCIE" in source and "form factor" in source


def test_docstrings_give_units_and_the_table_its_sources():
    for fn in (peak_tflops, layout_peak_tflops, device_peak_tflops):
        assert "TFLOP/s per GPU" in (fn.__doc__ or ""), fn.__name__
    src = Path(metrics.__file__).read_text()
    for source in ("whitepaper", "H100 datasheet", "H200 datasheet", "A100 datasheet", "HGX B200"):
        assert source in src, source
