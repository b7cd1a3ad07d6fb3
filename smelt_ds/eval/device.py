"""Where ``smelt-ds eval`` runs its models: ``--device`` and ``--dtype``.

Runs are opened as CPU fp32 models (:mod:`smelt_ds.runs.load`); :func:`place_runs` moves them to
the device and dtype asked for before any pass. Every pass then moves its inputs to the model's
own device with the one helper of :mod:`smelt_ds.parallel.device`
(``to_device(device_of(model), ...)``) and reads the results back to the CPU, so the numbers are
reduced in fp64 on the CPU whatever the device (:func:`smelt_ds.eval.loss.token_losses`). Sampled
decoding draws from :func:`sampling_generator`, on the model's device when it is CUDA.
"""

from __future__ import annotations

import torch

from smelt_ds.errors import ConfigError
from smelt_ds.parallel.hardware import cuda_bf16_native

__all__ = ["DEVICES", "DTYPES", "parse_device", "resolve_device", "resolve_dtype", "place_runs",
           "sampling_generator"]

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_device(text: str, what: str, choices: str = "cpu, cuda or cuda:N") -> torch.device:
    """``text`` as a CPU or CUDA ``torch.device`` (its index is not checked). Raises ConfigError
    naming ``what`` (the flag or model argument), the value and ``choices``."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise ConfigError(f"{what} ({text!r}) is not a device: use {choices}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{what} ({text!r}) is not supported: use {choices}")
    return dev


def resolve_device(text: str) -> torch.device:
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.

    Raises ConfigError naming ``--device`` for another value, for CUDA on a machine without it, and
    for a CUDA index this machine lacks."""
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = parse_device(text, "`--device`", "auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"`--device` ({text!r}): CUDA is not available on this machine "
                              "(torch.cuda.is_available() is False): use --device cpu (or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"`--device` ({text!r}): this machine has {torch.cuda.device_count()} CUDA "
                              f"device(s): use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return dev


def resolve_dtype(text: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a CUDA device with native bf16 (compute capability 8.0 or newer:
    :func:`smelt_ds.parallel.hardware.cuda_bf16_native`; what the SMELT recipes train in on GPUs),
    else float32 (also on V100 and T4, whose bf16 torch emulates); ``float32`` or ``bfloat16`` as
    asked (bfloat16 also on the CPU, slowly). Raises ConfigError naming ``--dtype`` for another
    value, or bfloat16 on a GPU without native bf16."""
    if text not in DTYPES:
        raise ConfigError(f"`--dtype` ({text!r}) is unknown: use auto, float32 or bfloat16")
    cuda_bf16 = device.type == "cuda" and cuda_bf16_native(device)
    if text == "auto":
        return torch.bfloat16 if cuda_bf16 else torch.float32
    if text == "bfloat16" and device.type == "cuda" and not cuda_bf16:
        raise ConfigError("`--dtype` ('bfloat16') is not supported by this GPU (bf16 needs compute capability "
                          "8.0 or newer): use float32 or auto")
    dtype = DTYPES[text]
    assert dtype is not None
    return dtype


def place_runs(runs, device: str = "cpu", dtype: str = "auto", log=print,
               verb: str = "evaluating") -> tuple[torch.device, torch.dtype]:
    """Move every run's model (``LoadedRun.model``) to ``device`` in ``dtype`` (see
    :func:`resolve_device`, :func:`resolve_dtype`), in place; says where when it is not CPU fp32
    (``verb``: what the models are for; ``"evaluating"`` adds that losses are reduced in fp64).
    Returns the device and dtype. Raises ConfigError as those do."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    for r in runs:
        r.model.to(device=dev, dtype=dt)
    if (dev.type, dt) != ("cpu", torch.float32):
        log(f"{verb} on {dev} in {str(dt).removeprefix('torch.')} (--device {device}, --dtype {dtype})"
            + ("; losses are reduced in fp64 on the CPU" if verb == "evaluating" else ""))
    return dev, dt


def sampling_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A ``torch.Generator`` seeded with ``seed`` for sampling from logits on ``device``: on that
    device when it is a CUDA device (``torch.multinomial`` of CUDA probabilities takes only a CUDA
    generator, and draws other numbers than the CPU's), else on the CPU (a CPU model; a device
    without generators of its own, such as ``meta``, is not given one)."""
    device = torch.device(device)
    return torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(seed)
