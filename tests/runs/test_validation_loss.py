"""The one validation-loss definition (smelt_ds.runs.validation_loss), checked against hand-computed
sums, and training's in-loop validation computing its numbers with it.

Every value below is a dyadic rational (x / 2^k with small k), so float64 represents the sums and
quotients exactly and the comparisons are exact."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from smelt_ds.runs.validation_loss import DomainLoss, combine_domains, validation_losses
from smelt_ds.train.validation import evaluate


def test_token_weighted_within_a_domain_and_domains_weighted_equally():
    parts = {"code": DomainLoss(nats=6.0, tokens=3), "text": DomainLoss(nats=1.0, tokens=4), "empty": DomainLoss()}
    # code 6/3 = 2, text 1/4 = 0.25; `all` their plain mean (the pooled 7/7 = 1 would be another number);
    # the domain without a label token is left out of both
    assert validation_losses(parts) == {"code": 2.0, "text": 0.25, "all": 1.125}
    combined = combine_domains(list(parts.values()))  # what `smelt-ds eval` reports as `all`
    assert combined.loss == 1.125 and combined.tokens == 7 and combined.nats == 7.0
    assert validation_losses({"empty": DomainLoss()}) == {}


def test_a_diverged_domain_makes_all_nan():
    out = validation_losses({"code": DomainLoss(nats=float("nan"), tokens=2), "text": DomainLoss(nats=1.0, tokens=4)})
    assert math.isnan(out["code"]) and math.isnan(out["all"]) and out["text"] == 0.25


class _Engine:
    """Returns ``lm_loss`` = the batch's first input id (the mean over its label tokens, as the
    engine's forward does); counts eval()/train() calls."""

    device = torch.device("cpu")  # a DeepSpeed engine's device: where validation moves the batches

    def __init__(self):
        self.modes: list[str] = []

    def __call__(self, input_ids, labels):
        return SimpleNamespace(lm_loss=input_ids[0, 0].double())

    def eval(self):
        self.modes.append("eval")

    def train(self):
        self.modes.append("train")


def _batch(loss: float, label_tokens: int, width: int = 4):
    labels = torch.full((1, width), -100)
    labels[0, :label_tokens] = 7
    return SimpleNamespace(input_ids=torch.full((1, width), loss), labels=labels)


def test_training_validation_sums_nats_and_tokens_per_domain():
    """code: batches of 3 tokens at 2.0 and 1 token at 6.0 nats/token -> 12 nats / 4 tokens = 3.0
    (the mean of the batch losses would be 4.0); text: 2 tokens at 0.5 -> 0.5. all = (3.0 + 0.5) / 2
    = 1.75 (pooled over tokens it would be 13 / 6)."""
    domains = {"code": [_batch(2.0, 3), _batch(6.0, 1)], "text": [_batch(0.5, 2)], "none": [_batch(9.0, 0)]}
    data = SimpleNamespace(validation=lambda n: {d: b[:n] for d, b in domains.items()})
    engine = _Engine()
    out = evaluate(engine, data, SimpleNamespace(eval=SimpleNamespace(eval_batches=2)))
    assert out == {"code": 3.0, "text": 0.5, "all": 1.75}
    assert engine.modes == ["eval", "train"]
