"""A second device on a CPU-only machine: tensors that say they live on ``meta`` while holding their
values on the CPU, and a mode that enforces what an accelerator enforces.

Inside :class:`FakeDevice` (a ``TorchFunctionMode``):

- ``t.to(FAKE)``, ``t.to(device=FAKE, ...)``, ``torch.tensor(..., device=FAKE)`` and every factory
  (``torch.zeros``, ``torch.arange``, ...) with ``device=FAKE`` give an :class:`OnFake` tensor: a CPU
  tensor whose ``.device`` is ``FAKE``; ``.to("cpu")`` / ``.cpu()`` of one gives a plain CPU tensor
  (a read back, as from a GPU), and ``.tolist()`` / ``.item()`` read it, as they read a CUDA tensor;
- an operation mixing an :class:`OnFake` tensor with a CPU tensor of one or more dimensions raises
  ``RuntimeError: Expected all tensors to be on the same device``, as CUDA does (0-dimensional CPU
  tensors are allowed beside device tensors, as on CUDA, and so are CPU index tensors);
- ``.numpy()`` of an :class:`OnFake` tensor raises, as it does for a CUDA tensor;
- :func:`on_fake_device` moves a module's parameters and buffers there (``device_of`` then answers
  ``FAKE``), so the real model computes on its CPU values: the numbers are the CPU's exactly.

``torch.Generator(device="meta")`` does not exist ("META device type not an accelerator"): code that
builds a generator on the model's device must build it there only for CUDA.

The model's grouped experts take the CPU branch for ``meta`` tensors (``device_branches``), so the
arithmetic is the CPU's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE = torch.device("meta")
CPU = torch.device("cpu")

__all__ = ["FAKE", "OnFake", "FakeDevice", "on_fake_device", "fake_device"]


class OnFake(torch.Tensor):
    """A CPU tensor whose ``.device`` is :data:`FAKE` (only meaningful inside :class:`FakeDevice`)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return FAKE

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, OnFake) else t


def _wrap(x):
    return x.as_subclass(OnFake) if isinstance(x, torch.Tensor) and not isinstance(x, OnFake) else x


def _wrap_all(out):
    """Every tensor of ``out`` (a tensor, or a tuple / list / named tuple of them) as OnFake."""
    if isinstance(out, torch.Tensor):
        return _wrap(out)
    if isinstance(out, (tuple, list)) and not isinstance(out, torch.Size):
        return tree_map(_wrap, out)
    return out


def _is_fake_device(d) -> bool:
    if d is None:
        return False
    try:
        return torch.device(d) == FAKE
    except (RuntimeError, TypeError):
        return False


#: operations that may read CPU index tensors beside a device tensor, as CUDA allows
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.copy_}
_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__len__, torch.Tensor.__repr__,
          torch.Tensor.__format__, torch._has_compatible_shallow_copy_type}  # reads, and a type query


def _histc(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``torch.histc`` of integers, which CUDA has and the CPU lacks (transformers' MoE experts use it
    off the CPU): the CPU's float histogram, in the input's dtype."""
    if x.dtype.is_floating_point:
        return torch.histc(x, *args, **kwargs)
    return torch.histc(x.float(), *args, **kwargs).to(x.dtype)


#: kernels a CUDA device has and the CPU lacks, computed for the fake device on the CPU
_CUDA_ONLY = {torch.histc: _histc}


class FakeDevice(TorchFunctionMode):
    """See the module docstring. ``moves``: how many tensors went from the CPU to :data:`FAKE`;
    ``mixed``: the operations refused for mixing devices (their names)."""

    def __init__(self) -> None:
        super().__init__()
        self.moves = 0
        self.mixed: list[str] = []
        self.overwrite_before = torch.__future__.get_overwrite_module_params_on_conversion()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda):
            return self._move(func, args, kwargs)
        if func is torch.Tensor.numpy and isinstance(args[0], OnFake):
            raise TypeError("can't convert meta device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        if _is_fake_device(kwargs.get("device")):  # a factory on the device: made on the CPU, said to be there
            out = func(*args, **{**kwargs, "device": CPU})
            return _wrap_all(out)
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        on_fake = any(isinstance(t, OnFake) for t in tensors)
        if on_fake and func not in _INDEXING and func not in _READS:
            host = [t for t in tensors if not isinstance(t, OnFake) and t.dim() > 0]
            if host:
                name = getattr(func, "__name__", str(func))
                self.mixed.append(name)
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"meta and cpu! ({name}: the fake device's check)")
        with torch._C.DisableTorchFunctionSubclass():
            out = _CUDA_ONLY[func](*args, **kwargs) if on_fake and func in _CUDA_ONLY else func(*args, **kwargs)
        if on_fake and func not in _READS and func is not torch.Tensor.__setitem__:
            if func is torch.Tensor.__getitem__ and not isinstance(args[0], OnFake):
                return out
            return _wrap_all(out)
        return out

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Within the block the mode is off (and ``module.to`` assigns ``param.data`` again): code that
        builds models on its own (``from_pretrained``) runs as it does on a plain CPU machine."""
        from torch.overrides import _pop_mode_temporarily

        flag = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(self.overwrite_before)
        try:
            with _pop_mode_temporarily():
                yield
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(flag)

    def _move(self, func, args, kwargs):
        t = args[0]
        if func is torch.Tensor.cpu:
            device, dtype = CPU, None
            non_blocking = bool(kwargs.get("non_blocking", False))
        elif func is torch.Tensor.cuda:
            raise RuntimeError("the fake device: .cuda() moves to a device this machine lacks")
        else:
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        del non_blocking
        src = _plain(t)
        with torch._C.DisableTorchFunctionSubclass():
            if device is not None and torch.device(device) == FAKE:
                out = src.to(dtype=dtype) if dtype is not None else src
                if not isinstance(t, OnFake):
                    self.moves += 1
                    out = out.clone() if out is src else out  # a copy, as a transfer is
                return out.as_subclass(OnFake)
            if device is not None and torch.device(device).type != "cpu":
                return func(*args, **kwargs)
            out = src.to(dtype=dtype) if dtype is not None else src
            if isinstance(t, OnFake):
                if device is None:  # a dtype change stays on the device
                    return out.as_subclass(OnFake)
                return out.clone() if out is src else out  # read back: a plain CPU copy
            return t.to(dtype=dtype) if dtype is not None else t


@contextlib.contextmanager
def fake_device() -> Iterator[FakeDevice]:
    """The mode, with the grouped experts on their CPU branch for ``meta`` tensors (the arithmetic
    is the CPU's), and ``module.to(FAKE)`` replacing each parameter by an :class:`OnFake` one (torch
    would otherwise assign ``param.data`` and keep the CPU parameter object)."""
    branches: contextlib.AbstractContextManager[None]
    try:
        from smelt_ds.model.grouped_gemm import device_branches
        branches = device_branches({"meta": "cpu"})
    except ImportError:  # a tree without the branch switch: meta tensors take the CUDA branch
        branches = contextlib.nullcontext()
    mode = FakeDevice()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        with branches, mode:
            yield mode
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(mode.overwrite_before)


def on_fake_device(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every parameter and buffer an :class:`OnFake` tensor (in place; returned).
    Call inside :func:`fake_device` (``module.to(FAKE)`` does the same there)."""
    with torch.no_grad():
        for m in module.modules():
            for name, p in list(m._parameters.items()):
                if p is not None and not isinstance(p, OnFake):
                    m._parameters[name] = torch.nn.Parameter(_plain(p.data).as_subclass(OnFake),
                                                             requires_grad=p.requires_grad)
            for name, b in list(m._buffers.items()):
                if b is not None and not isinstance(b, OnFake):
                    m._buffers[name] = b.as_subclass(OnFake)
    return module
