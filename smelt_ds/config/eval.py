"""The ``eval`` section of a recipe: validation during training and in-loop lm-evaluation-harness
tasks, with the checks between its fields."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from smelt_ds.config.schema import StrictModel
from smelt_ds.errors import fail

__all__ = ["EvalConfig"]


class EvalConfig(StrictModel):
    """Evaluation during training: validation loss every ``train.eval_every`` steps, and in-loop
    downstream evaluation with lm-evaluation-harness tasks every ``harness_interval`` steps
    (:mod:`smelt_ds.train.in_loop_harness`; OLMo-core's in-loop evaluator callback in spirit).

    The harness fields are checked here, at load time: ``harness_tasks`` and ``harness_interval``
    come together, and ``harness_include_path`` must be an existing directory. Whether each task
    name is known to lm-evaluation-harness is checked when training starts (indexing the
    harness's task YAMLs takes seconds, too long for every config load).
    """

    eval_batches: int = Field(8, gt=0, description="validation micro-batches per domain")
    harness_tasks: list[str] = Field(
        default_factory=list, description="lm-evaluation-harness task, group or tag names run on the model "
                                          "during training, every `eval.harness_interval` steps")
    harness_interval: int | None = Field(
        None, gt=0, description="steps between in-loop harness evaluations (at steps that are multiples of it); "
                                "required with `eval.harness_tasks`")
    harness_include_path: str | None = Field(
        None, description="directory of extra task YAMLs (lm-eval's --include_path), e.g. the offline tasks "
                          "`smelt-ds eval build-tasks OUT` writes; must exist")
    harness_num_fewshot: int = Field(0, ge=0, description="in-context examples (shots) per prompt, every task")
    harness_limit: int | None = Field(None, gt=0, description="examples per task (the first N); default: all")
    harness_batch_size: int = Field(8, gt=0, description="requests (sequences) per forward pass of the harness")

    @model_validator(mode="after")
    def _check_harness(self) -> EvalConfig:
        _check_harness_fields(self)
        return self


def _check_harness_fields(ev: EvalConfig) -> None:
    """The in-loop harness fields of ``ev`` together (see :class:`EvalConfig`). Raises ConfigError
    naming the fields, the values and the fix."""
    tasks, interval = ev.harness_tasks, ev.harness_interval
    if tasks and interval is None:
        fail("eval.harness_interval", None, f"is required with `eval.harness_tasks` ({tasks})",
             "set eval.harness_interval to the steps between harness evaluations (e.g. --set "
             "eval.harness_interval=500), or remove eval.harness_tasks")
    if interval is not None and not tasks:
        fail("eval.harness_tasks", tasks, f"is empty but `eval.harness_interval` ({interval}) is set",
             "name the tasks to run (e.g. --set 'eval.harness_tasks=[lambada_local]'), or remove "
             "eval.harness_interval")
    bad = [t for t in tasks if not isinstance(t, str) or not t.strip()]
    if bad:
        fail("eval.harness_tasks", tasks, "holds an empty task name", "remove the empty entry")
    twice = sorted({t for t in tasks if tasks.count(t) > 1})
    if twice:
        fail("eval.harness_tasks", tasks, f"names {twice} more than once", "list each task once")
    path = ev.harness_include_path
    if path is not None and not Path(path).expanduser().is_dir():
        what = "is a file" if Path(path).expanduser().exists() else "does not exist"
        fail("eval.harness_include_path", path, f"{what}: it must be a directory of lm-evaluation-harness task "
             "YAMLs", "write the offline tasks there with `smelt-ds eval build-tasks DIR`, point it at an "
             "existing directory, or remove it")
