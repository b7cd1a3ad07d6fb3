"""bf16 follows the hardware (issue 45, item 5): ``train.precision: auto`` and ``smelt-ds eval
--dtype auto`` choose bf16 only on CUDA devices of compute capability 8.0 or newer, through the one
helper :func:`smelt_ds.parallel.hardware.cuda_bf16_native`. ``torch.cuda.is_bf16_supported()`` is
True on V100 (sm70) and T4 (sm75) too, where torch emulates bf16: the fakes below report it True
on every device, as torch does, so only the capability can decide.

The CUDA queries are monkeypatched (this machine has no GPU): ``is_available``,
``get_device_capability`` (the device's (major, minor)) and ``is_bf16_supported``.
"""

from __future__ import annotations

import pytest
import torch

from smelt_ds.config.loading import config_from_dict
from smelt_ds.errors import ConfigError
from smelt_ds.eval.device import resolve_dtype
from smelt_ds.parallel.hardware import cuda_bf16_native, training_precision

# (name, compute capability, bf16 in hardware): V100, T4, A100, H100
DEVICES = [("V100", (7, 0), False), ("T4", (7, 5), False), ("A100", (8, 0), True), ("H100", (9, 0), True)]


def _fake_cuda(monkeypatch, capability: tuple[int, int] | None) -> list:
    """CUDA with one device of ``capability`` (None: no CUDA); returns the list of devices that
    ``get_device_capability`` was asked about."""
    asked: list = []

    def get_device_capability(device=None):
        asked.append(device)
        return capability

    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability is not None)
    monkeypatch.setattr(torch.version, "hip", None)
    return asked


def _cfg(precision: str):
    return config_from_dict({"model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                                       "max_seq_len": 32},
                             "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16},
                             "train": {"precision": precision, "seq_len": 16}})


@pytest.mark.parametrize("name,capability,native", DEVICES, ids=[d[0] for d in DEVICES])
def test_bf16_follows_compute_capability(monkeypatch, name, capability, native):
    asked = _fake_cuda(monkeypatch, capability)
    assert torch.cuda.is_bf16_supported()  # what the old test said on every one of them
    assert cuda_bf16_native() is native and asked  # decided by the capability
    # training: auto picks bf16 only with native support; bf16 asked for where it is emulated is refused
    assert training_precision(_cfg("auto")) == ("bf16" if native else "fp32")
    assert training_precision(_cfg("fp32")) == "fp32"
    if native:
        assert training_precision(_cfg("bf16")) == "bf16"
    else:
        with pytest.raises(ConfigError, match=rf"compute capability {capability[0]}\.{capability[1]}; bf16 needs 8\.0"):
            training_precision(_cfg("bf16"))
    # evaluation: the same rule for --dtype, asked about the evaluation's device
    cuda1 = torch.device("cuda", 1)
    asked.clear()
    assert resolve_dtype("auto", cuda1) == (torch.bfloat16 if native else torch.float32)
    assert asked == [cuda1]
    assert resolve_dtype("float32", cuda1) == torch.float32
    if native:
        assert resolve_dtype("bfloat16", cuda1) == torch.bfloat16
    else:
        with pytest.raises(ConfigError, match=r"`--dtype` \('bfloat16'\).*compute capability 8\.0"):
            resolve_dtype("bfloat16", cuda1)


def test_without_cuda_bf16_is_not_native_and_cpu_keeps_its_choices(monkeypatch):
    _fake_cuda(monkeypatch, None)
    assert cuda_bf16_native() is False
    assert training_precision(_cfg("auto")) == "fp32"
    assert training_precision(_cfg("bf16")) == "bf16"  # a CPU run in bf16 is the user's choice (slow, not refused)
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32 and resolve_dtype("bfloat16", cpu) == torch.bfloat16


def test_rocm_build_answers_with_torch(monkeypatch):
    """On a ROCm build the capability is a gfx version, not CUDA's: torch's own answer decides."""
    _fake_cuda(monkeypatch, (9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert cuda_bf16_native() is False
