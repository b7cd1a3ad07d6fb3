"""What lm-eval runs for the offline benchmarks (:mod:`smelt_ds.eval.benchmarks`): the task class
that adds the gold continuation's bits per byte, the ``bpb`` metric and BoolQ's ``process_docs``.

The task YAMLs name these by path (``!function smelt_ds.eval.benchmark_task.GoldBpbTask``), so lm-eval
imports this module only when it builds a benchmark task. It is apart from
:mod:`smelt_ds.eval.benchmarks` because ``lm_eval.api.task`` imports ``datasets`` (and pandas), which
the training loop, importing the harness for its in-loop evaluations, must not pay for.
"""

from __future__ import annotations

import math
from typing import Any

from lm_eval.api.task import ConfigurableTask

from smelt_ds.errors import ConfigError

__all__ = ["GoldBpbTask", "bpb", "boolq_labels"]



def bpb(items):
    """The ``bpb`` metric of the benchmark tasks (gold bits per byte, see the module docstring):
    a passthrough, as lm-eval's own aggregate-only metrics; :class:`GoldBpbTask` computes the
    per-document value and lm-eval's ``mean`` aggregates it."""
    return items


def boolq_labels(dataset):
    """``process_docs`` of ``boolq_val``: the shipped BoolQ rows hold ``answer`` (bool), lm-eval's
    ``boolq`` task reads ``label`` (0 = no, 1 = yes, as SuperGLUE's copy that lm-eval loads)."""
    return dataset.map(lambda doc: {"label": int(doc["answer"])})


class GoldBpbTask(ConfigurableTask):
    """lm-eval's :class:`~lm_eval.api.task.ConfigurableTask` (its prompts, requests and metrics
    unchanged) plus the ``bpb`` metric of the gold continuation when the task lists it.

    Constructed by lm-eval from a YAML with ``class: !function smelt_ds.eval.benchmark_task.GoldBpbTask``
    (the ``class`` key itself is not a task field and is dropped)."""

    def __init__(self, config: dict | None = None, **kwargs: Any) -> None:
        super().__init__(config={k: v for k, v in (config or {}).items() if k != "class"}, **kwargs)

    def process_results(self, doc: dict, results: list) -> dict:
        out = super().process_results(doc, results)
        if "bpb" in self._metric_fn_list:
            ll, context, continuation = self._gold(doc, results)
            scored = context[len(context.rstrip()):] + continuation
            out["bpb"] = -ll / (len(scored.encode("utf-8")) * math.log(2))
        return out

    def _gold(self, doc: dict, results: list) -> tuple[float, str, str]:
        """``(log-likelihood (nats), context, continuation)`` of the gold request of ``doc``."""
        if self.OUTPUT_TYPE == "loglikelihood":
            return float(results[0][0]), self.doc_to_text(doc), self.doc_to_target(doc)
        if self.OUTPUT_TYPE != "multiple_choice":
            raise ConfigError(f"task {self.config.task}: bpb needs a loglikelihood or multiple_choice task, not "
                              f"{self.OUTPUT_TYPE}")
        choices = self.doc_to_choice(doc)
        delimiter = self.config.target_delimiter
        if self.multiple_input:  # the options are contexts sharing one continuation (WinoGrande)
            gold = self.doc_to_text(doc)
            return float(results[gold][0]), choices[gold], delimiter + self.doc_to_target(doc)
        gold = self.doc_to_target(doc)
        gold = choices.index(gold) if isinstance(gold, str) else gold
        if not isinstance(gold, int):
            raise ConfigError(f"task {self.config.task}: bpb needs one gold choice per document, got {gold!r}")
        return float(results[gold][0]), self.doc_to_text(doc), delimiter + choices[gold]
