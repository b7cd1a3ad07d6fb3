"""Every tensor that enters the engine is on the engine's device: the real training step and
validation, driven with an engine on another device than the loader's.

The loaders build host tensors (``torch.from_numpy``); on a GPU the engine's weights are on
``cuda:N`` and a CPU index tensor fails the first embedding lookup. A CPU machine has one device
with storage, so the stand-in engine lives on ``meta``: it asserts the device of every input and
returns its losses on ``meta`` too, like a CUDA engine returns CUDA losses. A meta tensor has no
value, so any host read of a per-micro-batch value (``float(loss)``, ``.item()``) raises: the step
must keep its sums on the device until the one control exchange, which the test intercepts
(asserting what reaches it is still on the engine's device) and answers with the sums computed
here. On main before the fix (2e90da3) both tests fail at the engine's first input (a CPU tensor).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from smelt_ds.config.loading import load_config
from smelt_ds.model.lm import LMOutput
from smelt_ds.train import loop, validation
from smelt_ds.train.data import Batch
from smelt_ds.train.metrics import MicroStats
from smelt_ds.train.step_guard import StepGuardState

META = torch.device("meta")
B, S, ACCUM = 2, 8, 3


class MetaEngine:
    """A DeepSpeed engine's surface (call, backward, step, optimizer, device) on ``meta``; records
    the device of every tensor it is given."""

    device = META

    def __init__(self):
        self.seen: list[torch.device] = []
        self.calls = 0
        self.optimizer = SimpleNamespace(param_groups=[{"lr": 1e-3}])

    def __call__(self, input_ids, labels=None):
        self.seen += [input_ids.device, labels.device]
        assert input_ids.device == META and labels.device == META, (input_ids.device, labels.device)
        assert input_ids.shape == labels.shape == (B, S)
        self.calls += 1
        value = torch.full((), float(self.calls), device=META, requires_grad=True)
        return LMOutput(logits=torch.empty(B, S, 7, device=META), lm_loss=value, aux_loss=value * 0,
                        z_loss=value * 0)

    def backward(self, loss):
        assert loss.device == META

    def step(self):
        pass

    def gradient_accumulation_steps(self):
        return ACCUM

    def eval(self):
        pass

    def train(self):
        pass


def _host_batch(i: int) -> Batch:
    """A micro-batch as the loader builds it: host tensors."""
    ids = torch.arange(i, i + B * (S + 1)).reshape(B, S + 1)
    return Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), torch.arange(i, i + B))


def test_the_training_step_puts_every_input_on_the_engine_device(monkeypatch):
    cfg = load_config("recipes/tiny/smelt.yaml")
    engine = MetaEngine()
    batches = iter(_host_batch(i) for i in range(ACCUM))
    exchanged = []

    def agree(reason, values):  # the step's control exchange: what reaches it is still on the device
        exchanged.append(values.device)
        assert values.shape == (MicroStats.WIDTH,)
        # the engine's losses were 1, 2, 3 (lm = loss, aux = z = 0): sums on one rank, no stop
        return None, [6.0, 0.0, 3.0, 6.0, 6.0, 0.0, 0.0]

    monkeypatch.setattr(loop, "agree", agree)
    monkeypatch.setattr(loop, "_grad_norm_before_step", lambda engine, cfg: 1.0)
    fit = SimpleNamespace(built=SimpleNamespace(engine=engine, model=torch.nn.Module()), cfg=cfg, accum=ACCUM,
                          data=SimpleNamespace(train=SimpleNamespace(next_batch=lambda: next(batches))),
                          micro=MicroStats(), step=0, tokens_seen=0, tokens_per_step=ACCUM * B * S,
                          guard=StepGuardState(cfg.train.step_guard), skipped_since_log=0,
                          device=engine.device, stops=None, stop_reason=None)
    lr, ids, grad_norm, means = loop._train_step(fit)
    assert engine.calls == ACCUM and set(engine.seen) == {META}
    assert exchanged == [META]  # one exchange per step, fed from the device
    assert ids == [0, 1, 1, 2, 2, 3]  # sample ids stayed host values
    assert means == {"loss": 2.0, "lm_loss": 2.0, "aux_loss": 0.0, "z_loss": 0.0}
    assert fit.verdict.skip is None and fit.step == 1


def test_validation_puts_every_input_on_the_engine_device(monkeypatch):
    engine = MetaEngine()
    domains = {"code": [_host_batch(0), _host_batch(5)], "text": [_host_batch(9)]}
    data = SimpleNamespace(validation=lambda n: {d: b[:n] for d, b in domains.items()})
    reduced = []

    def all_reduce_sum(values):  # every domain's (nats, tokens) in one exchange, still on the device
        reduced.append((values.device, tuple(values.shape)))
        # losses 1 and 2 over 16 label tokens each (code), 3 over 16 (text)
        return [48.0, 32.0, 48.0, 16.0]

    monkeypatch.setattr(validation, "control", SimpleNamespace(all_reduce_sum=all_reduce_sum), raising=False)
    out = validation.evaluate(engine, data, SimpleNamespace(eval=SimpleNamespace(eval_batches=2)))
    assert set(engine.seen) == {META} and engine.calls == 3
    assert reduced == [(META, (4,))]
    assert out == {"code": 1.5, "text": 3.0, "all": 2.25}


@pytest.mark.parametrize("name", ["input_ids", "labels"])
def test_to_device_moves_host_tensors_and_keeps_device_ones(name):
    """``to_device``: a host tensor is copied to the target (same values, shape, dtype); one already
    there is returned as it is."""
    from smelt_ds.parallel.device import to_device

    batch = _host_batch(3)
    t = getattr(batch, name)
    (moved,) = to_device(META, t)
    assert moved.device == META and moved.shape == t.shape and moved.dtype == t.dtype
    (same,) = to_device("cpu", t)
    assert same is t
