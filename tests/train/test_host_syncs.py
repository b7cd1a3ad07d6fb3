"""Host syncs of one training step: a ceiling, independent of gradient accumulation.

Each host read of a device tensor's value waits for the GPU's queued work. The training step reads
values on the host in smelt-ds' own code exactly at these sites per optimizer step, whatever the
number of micro-batches (``tests/train/host_syncs.py`` counts them on a CPU by call site):

- ``train/stop.py:agree:to``: the step's control vector (losses for the step guard and the logs,
  MicroStats' sums kept on the device) copied to the host once, for the one control all-reduce: a
  sync;
- ``parallel/grad_norm.py:global_grad_norm:__float__``: the global gradient norm (the step guard's
  non-finite check and the logs): a sync;
- ``parallel/control.py:all_reduce_sum:tolist``: the all-reduced host copy: not a device read;
- ``train/loop.py:_train_step:tolist``, once per micro-batch: the loader's sample ids, host tensors
  that never go to the device: not a sync.

So the ceiling is 2 device syncs per optimizer step from smelt-ds' code. DeepSpeed's own reads
(``torch.optim.AdamW``'s step counters, host tensors) are not counted. On 2e90da3 the same step
read ``float(loss)`` per micro-batch and four more ``float()`` per micro-batch in
``MicroStats.add``, and ``global_grad_norm`` read its total twice: the test fails there.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from smelt_ds.testing import run_distributed

pytestmark = pytest.mark.distributed


def _count_worker(rank: int, world: int, accum: int) -> dict[str, int]:
    from smelt_ds.train import loop
    from smelt_ds.train.build import build
    from smelt_ds.train.data import Batch
    from smelt_ds.train.metrics import MicroStats
    from smelt_ds.train.step_guard import StepGuardState
    from tests.train.host_syncs import HostReads
    from tests.train.test_train_step import MICRO, SEQ, _cfg, shard

    cfg = _cfg("reference", 0, train={"gradient_accumulation_steps": accum})
    built = build(cfg, world)
    batches = iter([shard(rank, m, world, 2 * accum) for m in range(2 * accum)])

    def next_batch() -> Batch:
        ids = next(batches)
        return Batch(ids[:, :-1], ids[:, 1:], torch.arange(MICRO))

    fit = SimpleNamespace(built=built, cfg=cfg, accum=accum, data=SimpleNamespace(train=SimpleNamespace(
        next_batch=next_batch)), micro=MicroStats(), step=0, tokens_seen=0, tokens_per_step=MICRO * SEQ * accum,
        guard=StepGuardState(cfg.train.step_guard), skipped_since_log=0, device=built.engine.device, stops=None,
        stop_reason=None, writer=SimpleNamespace(write=lambda *a, **k: None),
        console=SimpleNamespace(line=lambda *a, **k: None))
    loop._train_step(fit)  # the first step builds optimizer state: count the second
    with HostReads() as reads:
        loop._train_step(fit)
    assert fit.verdict.skip is None
    return dict(reads.sites)


@pytest.mark.parametrize("accum", [1, 3])
def test_one_training_step_reads_the_device_twice(accum):
    sites = Counter(run_distributed(_count_worker, 1, args=(accum,), timeout=240)[0])
    assert sites == Counter({"train/stop.py:agree:to": 1, "parallel/grad_norm.py:global_grad_norm:__float__": 1,
                             "parallel/control.py:all_reduce_sum:tolist": 1, "train/loop.py:_train_step:tolist": accum})
