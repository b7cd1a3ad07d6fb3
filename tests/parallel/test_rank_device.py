"""A rank's CUDA device comes from the devices it sees and the ranks on its host, and DeepSpeed
computes on that same device; emulated on CPU as a Slurm task bound to one GPU
(``--gpus-per-task=1``: ``CUDA_VISIBLE_DEVICES`` one id, ``torch.cuda.device_count() == 1``) that is
local rank 1 of 2, where ``cuda:LOCAL_RANK`` (``cuda:1``) does not exist."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from smelt_ds.errors import ConfigError


class _Stop(Exception):
    """Raised by a stand-in to end the code under test once it has shown what it would do."""


@pytest.fixture
def environ():
    """os.environ as it was, after the test (init_distributed and train export variables)."""
    saved = dict(os.environ)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def one_gpu_task(monkeypatch, environ):
    """This process as rank 1 of 2 on its host under one GPU per task: CUDA 'available' with one
    visible device; ``torch.cuda.set_device`` records its argument (the list returned)."""
    calls: list[int] = []
    current = [0]

    def set_device(index):
        index = torch.device(index).index if not isinstance(index, int) else index
        if not 0 <= index < 1:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")  # what CUDA says of cuda:1 here
        calls.append(index)
        current[0] = index

    from deepspeed.accelerator import get_accelerator

    assert get_accelerator().device_name() == "cpu"  # chosen now, before CUDA seems available: it is cached
    environ.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", CUDA_VISIBLE_DEVICES="3",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    return calls


@pytest.mark.parametrize(("visible", "local", "local_world", "expected"), [
    (1, 1, 2, 0),   # one GPU per task: its own is cuda:0
    (1, 0, 1, 0),
    (4, 3, 4, 3),   # every GPU of the host visible to every rank: cuda:LOCAL_RANK
    (8, 1, 4, 1),   # more GPUs than ranks
])
def test_the_device_index_rule(visible, local, local_world, expected):
    from smelt_ds.parallel.distributed import cuda_device_index

    env = {"LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(local_world)}
    assert cuda_device_index(env, visible=visible) == expected


def test_fewer_visible_devices_than_ranks_is_refused():
    from smelt_ds.parallel.distributed import cuda_device_index

    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "0,1"}
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=1 of LOCAL_WORLD_SIZE=4 ranks on this host sees 2 CUDA "
                                          r"devices \(CUDA_VISIBLE_DEVICES='0,1'\)"):
        cuda_device_index(env, visible=2)


def test_the_process_group_is_bound_to_the_rank_device(one_gpu_task, monkeypatch):
    """DeepSpeed binds the default group to cuda:LOCAL_RANK (``device_id``, comm/torch.py) on a
    CUDA accelerator; init_distributed makes it with the rank's own device first."""
    import torch.distributed as dist

    from smelt_ds.parallel.distributed import init_distributed

    seen = {}

    def init_process_group(backend, **kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(_Stop):
        init_distributed()
    assert one_gpu_task == [0]
    assert seen.get("device_id") == torch.device("cuda", 0)


def test_the_engine_computes_on_the_rank_device(one_gpu_task, tiny_cfg, monkeypatch):
    """What engine.initialize gives deepspeed.initialize, fed to DeepSpeed's own engine code that
    picks the device (``DeepSpeedEngine._set_distributed_vars``) with a CUDA accelerator."""
    import deepspeed
    import deepspeed.runtime.engine as ds_engine

    from smelt_ds.model.lm import SmeltLM
    from smelt_ds.parallel import engine

    torch.cuda.set_device(0)  # what init_distributed does here (cuda:0, the one visible device)
    captured = {}

    def initialize(**kwargs):
        captured.update(kwargs)
        raise _Stop

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # bf16-capable
    a100 = SimpleNamespace(total_memory=80 << 30, major=8, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: a100)
    cfg = tiny_cfg()
    with pytest.raises(_Stop):
        engine.initialize(cfg, SmeltLM(cfg.model, cfg.moe, cfg.loop), world_size=1)

    picked = []
    cuda = SimpleNamespace(set_device=picked.append, device_name=lambda i=None: "cuda" if i is None else f"cuda:{i}",
                           device=lambda i=None: torch.device("cuda", i))
    monkeypatch.setattr(ds_engine, "get_accelerator", lambda: cuda)
    monkeypatch.setattr(ds_engine, "dist", SimpleNamespace(get_world_size=lambda: 2, get_rank=lambda: 1))
    stub = SimpleNamespace(local_rank=int(os.environ["LOCAL_RANK"]))
    ds_engine.DeepSpeedEngine._set_distributed_vars(stub, captured.get("args"))
    assert (stub.device, picked) == (torch.device("cuda", 0), [0])


def test_zero3_under_one_gpu_per_task_is_refused(one_gpu_task):
    """ZeRO-3 places parameters on cuda:LOCAL_RANK (deepspeed.zero.Init reads LOCAL_RANK)."""
    from smelt_ds.parallel.distributed import deepspeed_args

    with pytest.raises(ConfigError, match=r"ZeRO stage 3 .* cuda:LOCAL_RANK \(cuda:1\), but this rank sees only its "
                                          r"own GPU as cuda:0 \(CUDA_VISIBLE_DEVICES='3'"):
        deepspeed_args(zero_stage=3)
    assert deepspeed_args(zero_stage=2).device_rank == 0


def test_training_sets_the_device_when_the_group_exists_already(one_gpu_task, tiny_cfg, monkeypatch):
    """train() on a process group something else made (a test, a notebook) still sets the rank's
    device; the training body is replaced once the device is set."""
    import torch.distributed as dist

    from smelt_ds.parallel.distributed import find_free_port
    from smelt_ds.train import loop

    monkeypatch.setattr(loop, "_train", lambda *a, **k: "trained")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    try:
        assert loop.train(tiny_cfg()) == "trained"
    finally:
        dist.destroy_process_group()
    assert one_gpu_task == [0]
