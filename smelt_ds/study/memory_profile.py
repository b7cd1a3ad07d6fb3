"""Measured memory of a recipe: real training steps on this machine, next to the analytic estimate.

:func:`measure` builds the model, the MoE backend, activation checkpointing and (on CUDA) the
DeepSpeed engine as training does, runs a few steps on random tokens and reports the bytes
autograd saved for backward (:class:`SavedTensorCounter`, exact on any device) and, on CUDA, the
allocator peak (each checkpointing policy in a process of its own), beside
:func:`smelt_ds.parallel.memory.activation_bytes`'s prediction. It sits above the analytic
:mod:`smelt_ds.parallel.memory` (the cost layer) because it needs an engine.
"""

from __future__ import annotations

import multiprocessing
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from typing import Any

import torch

from smelt_ds.config.loading import config_from_dict, config_to_dict
from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError
from smelt_ds.model import SmeltLM
from smelt_ds.parallel.device import to_device
from smelt_ds.parallel.distributed import init_distributed
from smelt_ds.parallel.engine import configure_activation_checkpointing
from smelt_ds.parallel.memory import POLICIES, activation_bytes, estimate, model_states, param_counts
from smelt_ds.train.build import build
from smelt_ds.train.objective import total_loss

__all__ = ["SavedTensorCounter", "Measurement", "measure"]

# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------


class _Packed:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedTensorCounter:
    """Counts the bytes autograd saves for backward, exactly, through
    ``torch.autograd.graph.saved_tensors_hooks``.

    Every saved tensor is wrapped in a handle that lives exactly as long as the graph node
    holding it; :meth:`saved_bytes` sums the storages (deduplicated by storage, so views and
    tensors saved twice count once) of the live handles, leaving out the storages of the tensors
    given (parameters: model states, counted separately; buffers such as the RoPE tables, whose
    slices attention saves: they exist whether or not anything is saved). Inputs kept by activation
    checkpoints are saved by the checkpoint itself, not through autograd's hooks;
    :meth:`wrap_checkpoint` registers them.

    Usage::

        counter = SavedTensorCounter([*model.parameters(), *model.buffers()])
        with counter:
            out = model(ids, labels=labels)
        n = counter.saved_bytes()   # before backward frees them
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._exclude = {p.untyped_storage().data_ptr() for p in parameters}
        self._handles: weakref.WeakSet = weakref.WeakSet()
        self._inputs: list[torch.Tensor] = []
        self._ctx: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, t: torch.Tensor) -> _Packed:
        h = _Packed(t)
        self._handles.add(h)
        return h

    @staticmethod
    def _unpack(h: _Packed) -> torch.Tensor:
        return h.tensor

    def __enter__(self) -> SavedTensorCounter:
        self._handles = weakref.WeakSet()
        self._inputs = []
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._ctx is not None  # set by __enter__
        self._ctx.__exit__(*exc)

    def wrap_checkpoint(self, checkpoint_fn):
        """A ``checkpoint_fn(fn, x)`` that records ``x`` as saved, then calls ``checkpoint_fn``."""

        def counted(fn, x):
            self._inputs.append(x)
            return checkpoint_fn(fn, x)

        return counted

    def saved_bytes(self) -> int:
        """Bytes of the distinct storages of live saved tensors and checkpoint inputs."""
        seen: dict[tuple[str, int], int] = {}
        for t in [h.tensor for h in list(self._handles)] + self._inputs:
            st = t.untyped_storage()
            if st.data_ptr() in self._exclude:
                continue
            seen[(str(t.device), st.data_ptr())] = st.nbytes()
        return sum(seen.values())

    def release(self) -> None:
        """Drop the references to checkpoint inputs (after backward)."""
        self._inputs = []


@dataclass
class Measurement:
    """Measured next to predicted for one checkpointing policy (bytes; one process).

    CPU: ``saved_activations`` (:class:`SavedTensorCounter`) and the parameter, gradient and
    optimizer storage after a step, with ``predicted_activations`` (``activation_bytes(...).
    stored`` for CPU) and ``predicted_model_states`` (fp32 ZeRO-0, 1 GPU). CUDA: ``peak_allocated``
    (``torch.cuda.max_memory_allocated``) with ``predicted_total`` (ZeRO-stage of the recipe, 1
    GPU)."""

    policy: str
    device: str
    saved_activations: int | None
    params: int
    grads: int
    optimizer: int
    peak_allocated: int | None
    predicted_activations: int
    predicted_model_states: int
    predicted_total: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    seen = {}
    for t in tensors:
        if t is not None and isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _random_batch(cfg: RunConfig, step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    B, S, V = cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.vocab_size
    ids, labels = to_device(device, torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g))
    return ids, labels


def _with_policy(cfg: RunConfig, policy: str, impl: str | None = None, **train: Any) -> RunConfig:
    """``cfg`` with checkpointing ``policy`` (and ``impl``, other ``train`` fields), re-validated."""
    raw = config_to_dict(cfg)
    raw["train"]["activation_checkpointing"]["policy"] = policy
    if impl is not None:
        raw["train"]["activation_checkpointing"]["impl"] = impl
    raw["train"].update(train)
    return config_from_dict(raw, source=f"recipe {cfg.name!r} with policy {policy!r}")


def _measure_cpu(cfg: RunConfig, policy: str, steps: int) -> Measurement:

    impl = cfg.train.activation_checkpointing.impl
    if impl == "deepspeed" and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        impl = "torch"  # deepspeed.checkpointing needs a process group; both keep the same tensors
    run_cfg = _with_policy(cfg, policy, impl)
    torch.manual_seed(cfg.train.seed)
    model = SmeltLM(run_cfg.model, run_cfg.moe, run_cfg.loop).train()
    configure_activation_checkpointing(model, run_cfg)
    counter = SavedTensorCounter([*model.parameters(), *model.buffers()])
    model.blocks.wrap_checkpoint_fn(counter.wrap_checkpoint)  # no-op without checkpointing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    saved = 0
    for step in range(steps):
        ids, labels = _random_batch(cfg, step, "cpu")
        with counter:
            out = model(ids, labels=labels)
        saved = max(saved, counter.saved_bytes())
        total_loss(out, run_cfg.train).backward()
        counter.release()
        opt.step()
        if step < steps - 1:
            opt.zero_grad(set_to_none=False)
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    pred_act = activation_bytes(run_cfg, policy, cfg.train.micro_batch_size, cfg.train.seq_len, 4, "cpu").stored
    pred_ms = model_states(param_counts(cfg), 1, 1, 0, precision="fp32").gpu
    return Measurement(policy, "cpu", saved, _storage_bytes(model.parameters()),
                       _storage_bytes(p.grad for p in model.parameters()), _storage_bytes(states), None,
                       pred_act, pred_ms)


def _measure_cuda(cfg: RunConfig, policy: str, steps: int) -> Measurement:
    """One GPU through the DeepSpeed engine with the recipe's ZeRO stage and precision. Run it in
    a process of its own (:func:`_measure_each_in_own_process`): the allocator's peak counts
    whatever the process still holds, e.g. an earlier measurement's cached blocks, engine buffers
    or communication state."""

    if not torch.distributed.is_initialized():
        init_distributed()
    run_cfg = _with_policy(cfg, policy, init_from=None)  # the weights' values do not change the memory
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    built = build(run_cfg, 1)  # the model, backend, checkpointing and engine exactly as training builds them
    model, engine = built.model, built.engine
    for step in range(steps):
        ids, labels = _random_batch(cfg, step, engine.device)
        out = engine(ids, labels=labels)
        engine.backward(total_loss(out, run_cfg.train))
        engine.step()
    torch.cuda.synchronize()
    peak = int(torch.cuda.max_memory_allocated())
    rep = estimate(run_cfg, 1, 1, torch.cuda.get_device_properties(0).total_memory, policies=[policy])
    row = rep.configured
    params = _storage_bytes(engine.module.parameters())
    del engine, model, built
    torch.cuda.empty_cache()
    return Measurement(policy, "cuda", None, params, 0, 0, peak, row.activations if row else 0,
                       row.model_states if row else 0, row.total if row else None)


MeasureFn = Callable[[RunConfig, str, int], Measurement]


def _measure_each_in_own_process(fn: MeasureFn, cfg: RunConfig, policies: Iterable[str],
                                 steps: int) -> list[Measurement]:
    """``fn(cfg, policy, steps)`` for each policy in order, each in a new process (``spawn``: a
    fresh interpreter, no CUDA context, allocator or process group inherited from this one or
    from the previous policy), one at a time; returns their results in ``policies``' order.
    ``fn`` must be importable by name (a module-level function) and ``cfg`` picklable. An
    exception in a measurement is raised here; a process that dies (e.g. killed for memory)
    raises RuntimeError naming the policy."""
    ctx = multiprocessing.get_context("spawn")
    out = []
    for policy in policies:
        with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            try:
                out.append(pool.submit(fn, cfg, policy, steps).result())
            except BrokenProcessPool as e:
                raise RuntimeError(f"the memory measurement of policy {policy!r} died in its process "
                                   f"({e}); nothing was measured for it") from e
    return out


def measure(cfg: RunConfig, policies: Iterable[str] | None = None, steps: int = 2,
            device: str | None = None) -> list[Measurement]:
    """Run ``steps`` real training steps per policy and measure memory.

    CPU (in this process): exact saved-tensor bytes (:class:`SavedTensorCounter`) and parameter /
    gradient / optimizer storage of a plain PyTorch AdamW step (ZeRO-0, fp32: what one CPU rank
    holds); neither depends on what the process held before. CUDA: the caching allocator's peak
    (``torch.cuda.max_memory_allocated``) of the DeepSpeed engine on one GPU with the recipe's
    ZeRO stage and precision, each policy in a process of its own
    (:func:`_measure_each_in_own_process`), so that no peak includes another policy's leftovers.
    Raises ConfigError for an unknown policy.
    """
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    pols = list(policies) if policies is not None else list(POLICIES)
    bad = [p for p in pols if p not in POLICIES]
    if bad:
        raise ConfigError(f"unknown checkpointing policies {bad}: use {list(POLICIES)}")
    if dev == "cuda":
        return _measure_each_in_own_process(_measure_cuda, cfg, pols, steps)
    return [_measure_cpu(cfg, p, steps) for p in pols]


