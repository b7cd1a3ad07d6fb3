"""``train.activation_checkpointing.cpu_checkpointing`` (issue 45, item 5): what is CUDA-only about
it, and what of it runs on CPU.

Why CUDA-only: ``configure_activation_checkpointing`` passes the option to DeepSpeed
(``deepspeed.checkpointing.configure(checkpoint_in_cpu=True)``) only on a device accelerator.
DeepSpeed 0.19.8 moves a checkpoint's input to host memory by one of three paths:

* with ``partition_activations``: each partition ``.cpu()`` (a clone, then a host copy on CUDA);
* without it, on an accelerator with streams (CUDA): its asynchronous ``_ActivationOffloadEngine``;
* without it, on a synchronized accelerator (the CPU accelerator): blocking copies,
  ``inputs = copy_to_device(args, cpu)`` then ``get_cpu_activations_for_backward(args, inputs)``,
  which sets ``arg.data`` to an empty 0-d tensor and keeps ``arg.saved_data = inp.data``. On the
  CPU ``.to('cpu')`` returns the tensor itself, so ``inp`` is ``arg`` and what it keeps is the
  emptied placeholder: the input is lost, and the recompute in backward gets a 0-d tensor
  (``RuntimeError: both arguments to linear need to be at least 1D, but they are 0D and 2D``).

What is tested here: the options we pass are what DeepSpeed's own config class reads from the
same keys; the lost input on the CPU (DeepSpeed's own functions, and a recompute that fails); and,
as on CUDA, the option passed on together with ``partition_activations`` (the first path, which
runs on the CPU), through our configuration on a tiny SMELT with dropout and router jitter, which
reproduces the run without checkpointing bit for bit (same kernels, same order: equality). The
asynchronous offload path needs CUDA streams (``get_accelerator().Stream`` is None on the CPU
accelerator, and ``_get_cpu_offload_engine`` returns None for a synchronized device): not
testable here.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from smelt_ds.config.loading import config_from_dict  # noqa: E402
from smelt_ds.model import SmeltLM  # noqa: E402
from smelt_ds.parallel import engine  # noqa: E402
from smelt_ds.parallel.engine import configure_activation_checkpointing  # noqa: E402
from smelt_ds.testing import run_distributed  # noqa: E402
from smelt_ds.train.objective import total_loss  # noqa: E402


def _raw(policy="looped", **ac):
    return {"name": "cpu-ckpt", "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4,
                                          "num_kv_heads": 2, "max_seq_len": 32, "dropout": 0.1},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16, "router_jitter": 0.2},
            "loop": {"position": "middle"},
            "train": {"seq_len": 16, "micro_batch_size": 2,
                      "activation_checkpointing": {"policy": policy, "impl": "deepspeed", **ac}}}


def _configured(monkeypatch, device_name: str, **ac):
    """Configure a tiny SMELT's checkpointing with the accelerator named ``device_name``; returns
    the keywords given to ``deepspeed.checkpointing.configure`` and the manager's setup."""
    seen = {}
    accelerator = SimpleNamespace(device_name=lambda: device_name)
    monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: accelerator)
    monkeypatch.setattr(deepspeed.checkpointing, "configure", lambda mpu, **kw: seen.update(kw))
    monkeypatch.setattr(engine, "_CPU_CHECKPOINTING_WARNED", False)
    cfg = config_from_dict(_raw(**ac))
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        configure_activation_checkpointing(model, cfg)
    return seen, model.blocks.checkpointing, [str(w.message) for w in caught], len(model.schedule.plan)


@pytest.mark.parametrize("partition,contiguous", [(False, False), (True, False), (True, True)])
def test_options_passed_on_a_device_accelerator_are_deepspeeds_config_keys(monkeypatch, partition, contiguous):
    """On CUDA the recipe's options reach ``deepspeed.checkpointing.configure`` unchanged, and
    they are what DeepSpeed's own ``DeepSpeedActivationCheckpointingConfig`` reads from an
    ``activation_checkpointing`` section with the recipe's keys (our field names are DeepSpeed's
    keys); the manager knows the checkpoint input is emptied."""
    from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig

    seen, setup, warned, n_plan = _configured(monkeypatch, "cuda", cpu_checkpointing=True,
                                              partition_activations=partition,
                                              contiguous_memory_optimization=contiguous)
    assert seen == {"partition_activations": partition, "checkpoint_in_cpu": True,
                    "contiguous_checkpointing": contiguous, "num_checkpoints": n_plan}
    assert warned == [] and setup.frees_inputs is True
    section = {"partition_activations": partition, "cpu_checkpointing": True,
               "contiguous_memory_optimization": contiguous, "number_checkpoints": n_plan}
    ds = DeepSpeedActivationCheckpointingConfig({"activation_checkpointing": section})
    assert (ds.partition_activations, ds.cpu_checkpointing, ds.contiguous_memory_optimization,
            ds.number_checkpoints) == (seen["partition_activations"], seen["checkpoint_in_cpu"],
                                       seen["contiguous_checkpointing"], seen["num_checkpoints"])


def test_option_dropped_with_a_warning_on_the_cpu_accelerator(monkeypatch):
    seen, setup, warned, _ = _configured(monkeypatch, "cpu", cpu_checkpointing=True)
    assert seen["checkpoint_in_cpu"] is False and setup.frees_inputs is False
    assert len(warned) == 1 and "ignored on a CPU accelerator" in warned[0]


def test_deepspeed_blocking_cpu_copy_loses_a_cpu_input():
    """The reason, in DeepSpeed's own functions: the host "copy" of a CPU tensor is the tensor
    itself, and what is kept for backward is the emptied 0-d placeholder, not the values."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt
    from deepspeed.runtime.utils import copy_to_device

    x = torch.randn(4, 8)
    inputs = copy_to_device((x,), torch.device("cpu"), ds_ckpt.is_activation_to_checkpoint)
    assert inputs[0] is x
    (kept,) = ds_ckpt.get_cpu_activations_for_backward((x,), inputs)
    assert kept.saved_data.shape == torch.Size([]) and x.shape == torch.Size([])  # the (4, 8) values are gone


def _step(raw, device_name=None):
    """One forward and backward of the tiny SMELT (seeded dropout and jitter); with
    ``device_name``, checkpointing is configured as on that accelerator."""
    cfg = config_from_dict(raw)
    torch.manual_seed(0)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop).train()
    if device_name is None:
        configure_activation_checkpointing(model, cfg)
    else:
        accelerator = SimpleNamespace(device_name=lambda: device_name)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("deepspeed.accelerator.get_accelerator", lambda: accelerator)
            configure_activation_checkpointing(model, cfg)
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    out = model(ids[:, :-1], labels=ids[:, 1:])
    loss = total_loss(out, cfg.train)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "cpu_checkpoint": ds_ckpt.CPU_CHECKPOINT, "partition": ds_ckpt.PARTITION_ACTIVATIONS}


def _cpu_checkpointing_worker(rank, world):
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    res = {"ref": _step(_raw("none"))}
    for policy in ("looped", "full"):
        res[policy] = _step(_raw(policy, cpu_checkpointing=True, partition_activations=True), device_name="cuda")
    # the blocking path (no partitioning) on the CPU: the recompute gets the emptied input
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True)
    lin = torch.nn.Linear(8, 8)
    h = torch.randn(4, 8, requires_grad=True) * 2.0
    try:
        ds_ckpt.non_reentrant_checkpoint(lin, h).sum().backward()
        res["blocking"] = "no error"
    except RuntimeError as e:
        res["blocking"] = str(e)
    return res


@pytest.fixture(scope="module")
def ds_cpu_checkpointing():
    return run_distributed(_cpu_checkpointing_worker, world_size=1, timeout=240)[0]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["looped", "full"])
def test_cpu_checkpointing_with_partitioning_reproduces_no_checkpointing(ds_cpu_checkpointing, policy):
    """``cpu_checkpointing`` passed on as on CUDA (with ``partition_activations``): DeepSpeed ran
    with it, and loss and every gradient equal the run without checkpointing exactly."""
    got, ref = ds_cpu_checkpointing[policy], ds_cpu_checkpointing["ref"]
    assert got["cpu_checkpoint"] is True and got["partition"] is True
    assert torch.equal(got["loss"], ref["loss"])
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        assert torch.equal(got["grads"][name], g), name


@pytest.mark.slow
def test_cpu_checkpointing_without_partitioning_fails_on_the_cpu(ds_cpu_checkpointing):
    """Why the option is not passed on a CPU accelerator: DeepSpeed's blocking path loses the
    input (module docstring). If this starts passing, DeepSpeed fixed it: pass the option on."""
    assert "0D" in ds_cpu_checkpointing["blocking"], ds_cpu_checkpointing["blocking"]
