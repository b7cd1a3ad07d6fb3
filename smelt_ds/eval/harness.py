"""lm-evaluation-harness model of SMELT and Baseline runs (``lm_eval`` 0.4.x, registered as ``smelt-ds``).

Two ways to run it:

- ``smelt-ds eval RUN [RUN...] --harness TASKS [--num-fewshot K] [--include-path DIR]`` calls
  :func:`lm_eval.simple_evaluate` with the in-memory model (:func:`run_harness`) and writes the
  harness's results JSON next to our report (:mod:`smelt_ds.eval.cli`).
- ``smelt-ds lm-eval run --model smelt-ds --model_args pretrained=RUN --tasks ... [--include_path DIR]``
  (or ``python -m smelt_ds.eval.harness run ...``) runs lm-eval's own command line with the model
  registered first. lm-eval 0.4.13 finds models only in its own ``MODEL_MAPPING`` (no plugin entry
  point) and imports ``--include_path`` task code only after the model is looked up, so a plain
  ``lm_eval --model smelt-ds`` cannot find this model.

Conventions (those of the harness's ``HFLM`` for a causal decoder, ``lm_eval/models/huggingface.py``):

- Tokens: the run's byte-level BPE tokenizer (``tokenizers.Tokenizer``), no special tokens added
  (:meth:`SmeltHarnessLM.tok_encode`). ``eot_token_id`` = ``prefix_token_id`` = the end-of-text id
  the model was trained after (documents are separated by it, see
  :func:`smelt_ds.eval.generation.encode_prompt`); it conditions an empty context and the first
  rolling window.
- ``loglikelihood``: requests sorted by length, longest first (``lm_eval.models.utils.Collator``),
  in batches of ``batch_size`` right-padded rows; the model reads
  ``(context + continuation)[-(max_length + 1):][:-1]`` and the continuation's tokens are scored
  at their own positions: log-likelihood = sum of ``log_softmax`` (float32) of the continuation
  tokens (summed exactly rounded with :func:`math.fsum`, so the value does not depend on the
  order of the summation), ``is_greedy`` = every continuation token is the argmax. The model is
  causal, so right padding sits after every scored position; see :func:`continuation_logprobs`.
  A continuation longer than ``max_length`` (HFLM refuses it) is scored in consecutive pieces of
  ``max_length`` tokens (``SmeltHarnessLM._loglikelihood_tokens``).
- ``loglikelihood_rolling``: ``lm_eval.utils.get_rolling_token_windows(tokens, prefix_token=eot,
  max_seq_len=max_length, context_len=1)`` + ``make_disjoint_window``: disjoint windows of
  ``max_length`` predicted tokens, each token predicted once; the document's log-likelihood is the
  sum over its windows.
- ``generate_until``: contexts left-truncated to ``max_length - max_gen_toks`` tokens, decoded with
  :meth:`smelt_ds.model.SmeltLM.generate` (per-visit KV cache) in batches of equal-length
  contexts (the model has no padding mask), greedy (``do_sample`` false or temperature 0) or
  sampled (``temperature``, ``top_p``, a ``torch.Generator`` seeded with ``seed`` per call),
  ``max_gen_toks`` new tokens at most, stopped at end-of-text and cut at the first ``until``
  string.
- Test-time loop count: ``loop_repeats`` R and ``exit_after`` P run the plan of
  :func:`smelt_ds.config.loop.loop_with_repeats` (same weights; the KV cache has one slot per
  visit of that plan) during every request, and the model's own plan afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM

from smelt_ds.config.loop import LoopConfig, loop_with_repeats
from smelt_ds.config.schedule import build_schedule
from smelt_ds.data.tokenizer import special_ids
from smelt_ds.errors import ConfigError
from smelt_ds.eval.benchmarks import downloads_named, tasks_dir_for
from smelt_ds.eval.data import open_eval_data
from smelt_ds.eval.device import parse_device, sampling_generator
from smelt_ds.parallel.device import device_of, to_device
from smelt_ds.runs.load import load_run
from smelt_ds.runs.tokenizer_file import load_tokenizer, tokenizer_hash

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager
    from tokenizers import Tokenizer

    from smelt_ds.model import SmeltLM

__all__ = ["MODEL_NAME", "BOOTSTRAP_ITERS", "SmeltHarnessLM", "continuation_logprobs", "score_continuation",
           "register", "run_tokenizer", "task_manager", "check_tasks", "sorted_samples", "run_harness",
           "evaluate_model", "run_lm_eval", "main"]

log = logging.getLogger(__name__)

MODEL_NAME = "smelt-ds"
#: bootstrap resamples for the stderr of non-mean metrics (perplexities); lm-eval's default is 100000
BOOTSTRAP_ITERS = 1000
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: generation options of a task's ``generation_kwargs`` this model honours; sampling-only options
#: are ignored (with a warning) under greedy decoding and refused when sampling
GEN_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p"}
SAMPLING_ONLY_KEYS = {"top_k", "min_p", "typical_p"}


# ---------------------------------------------------------------------------------------------
# option parsing (model_args arrive as strings from the command line, typed from Python)
# ---------------------------------------------------------------------------------------------


def _int_opt(name: str, value, minimum: int = 1) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        v = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"model argument `{name}` ({value!r}) must be an integer >= {minimum}") from None
    if v < minimum:
        raise ConfigError(f"model argument `{name}` ({v}) must be >= {minimum}")
    return v


def _bool_opt(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", "none", ""):
        return False
    raise ConfigError(f"model argument `{name}` ({value!r}) must be true or false")


def _device_opt(value) -> torch.device | None:
    """``cpu``, ``cuda`` or ``cuda:i``. As lm-eval's HFLM does, ``cuda:i`` naming no device of this
    machine (lm-eval's command line passes ``cuda:0`` by default) falls back to ``cuda`` when CUDA
    is available, else to ``cpu``, with a warning; ``cuda`` without CUDA raises ConfigError."""
    if value is None:
        return None
    text = str(value).strip()
    dev = parse_device(text, "model argument `device`", "cpu or cuda[:i]")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        fallback = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.warning("device %r is not present (%d CUDA devices): using %s", text, torch.cuda.device_count(), fallback)
        return fallback
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model argument `device` ({text!r}): CUDA is not available on this machine "
                          "(torch.cuda.is_available() is False): use device=cpu")
    return dev


def _dtype_opt(value) -> torch.dtype | None:
    if value is None:
        return None
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    text = str(value).strip().removeprefix("torch.")
    if text not in DTYPES:
        raise ConfigError(f"model argument `dtype` ({value!r}) must be one of {', '.join(DTYPES)}")
    return DTYPES[text]


# ---------------------------------------------------------------------------------------------
# scoring: one batched forward per chunk of (input window, continuation) rows
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def continuation_logprobs(model: SmeltLM, windows: list[tuple[list[int], list[int]]], pad_id: int,
                          device: torch.device | None = None) -> list[torch.Tensor]:
    """Log-probabilities at the scored positions of each row, from one right-padded forward.

    ``windows``: ``(input_ids, continuation_ids)`` per row; ``input_ids`` (length ``n``) is what
    the model reads (the caller built ``(context + continuation)[:-1]``), and its last
    ``len(continuation_ids)`` positions predict the continuation. Rows are padded on the right
    with ``pad_id`` to the longest row, ``(B, S_max)``; the model is causal, so no padded position
    influences a scored one. Returns per row ``log_softmax(logits.float())`` at those positions,
    ``(len(continuation), V)`` float32 (nats), in row order; only the scored positions go
    through ``log_softmax``. The batch goes to ``device`` (default: the model's,
    :func:`~smelt_ds.parallel.device.device_of`) with :func:`~smelt_ds.parallel.device.to_device`.
    """
    if not windows:
        return []
    dev = device if device is not None else device_of(model)
    S = max(len(inp) for inp, _ in windows)
    batch_BS = torch.full((len(windows), S), pad_id, dtype=torch.long)
    rows: list[int] = []
    cols: list[int] = []
    for i, (inp, cont) in enumerate(windows):
        batch_BS[i, : len(inp)] = torch.tensor(inp, dtype=torch.long)
        rows += [i] * len(cont)
        cols += range(len(inp) - len(cont), len(inp))
    (batch_BS,) = to_device(dev, batch_BS)
    logits_BSV = model(batch_BS).logits
    picked_NV = logits_BSV[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)]  # N = scored tokens
    logp_NV = F.log_softmax(picked_NV.float(), dim=-1)
    return list(logp_NV.split([len(cont) for _, cont in windows]))


def score_continuation(logp_CV: torch.Tensor, cont: list[int]) -> tuple[float, bool]:
    """``(log-likelihood (nats), is_greedy)`` of continuation ``cont`` (length ``n``) from the
    log-probabilities of its positions, the last ``n`` rows of ``logp_CV`` ``(>= n, V)``: the sum of
    the tokens' log-probabilities, exactly rounded (:func:`math.fsum`: independent of the order of
    the summation), and whether every token is its row's argmax."""
    lp_nV = logp_CV[logp_CV.shape[0] - len(cont):]
    target_n = torch.tensor(cont, dtype=torch.long, device=lp_nV.device)
    token_lp = lp_nV.gather(1, target_n[:, None]).squeeze(1).tolist()
    return math.fsum(token_lp), bool((lp_nV.argmax(dim=-1) == target_n).all())


# ---------------------------------------------------------------------------------------------
# the harness model
# ---------------------------------------------------------------------------------------------


class SmeltHarnessLM(TemplateLM):
    """A SMELT or Baseline :class:`smelt_ds.model.SmeltLM` as an lm-evaluation-harness model.

    Model arguments (``--model_args key=value,...``; strings parse):
        pretrained: run directory (its newest complete checkpoint is exported once), checkpoint
            directory or export directory (:func:`smelt_ds.runs.load.load_run`).
        batch_size: rows per forward (int, default 8; ``auto`` is not supported).
        max_length: tokens per forward window (default ``model.max_seq_len``; larger is an error).
        max_gen_toks: default new tokens of ``generate_until`` when a task does not say (256).
        device: ``cpu`` (default) or ``cuda[:i]`` (a ``cuda:i`` this machine lacks falls back to
            ``cuda`` or ``cpu``, as in HFLM). dtype: ``float32`` (default) or ``bfloat16``.
        loop_repeats, exit_after: test-time loop count R and early exit after P passes of every
            loop range (:func:`smelt_ds.config.loop.loop_with_repeats`); looped runs only.
        allow_other_tokenizer: score with ``data.tokenizer.path`` even when it is not the run's.
        seed: seed of sampled generation (default 1234). logits_cache: reuse one forward for
            requests that differ only in their last continuation token (HFLM's default, true).
        max_batch_size: accepted from the harness's command line and ignored (no auto batch size).
    """

    backend = "causal"

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> SmeltHarnessLM:
        """lm-eval's command line: ``--model_args`` merged with the values it passes itself
        (``batch_size``, ``max_batch_size``, ``device``); a key given in ``--model_args`` wins
        instead of raising TypeError ("multiple values for keyword argument")."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None
                            ) -> SmeltHarnessLM:
        """As :meth:`create_from_arg_string`, from a dict (what lm-eval 0.4.13's CLI passes)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    def __init__(self, pretrained: str | None = None, batch_size: int | str = 8, max_length: int | str | None = None,
                 device: str | None = None, dtype: str | None = None, loop_repeats: int | str | None = None,
                 exit_after: int | str | None = None, allow_other_tokenizer: bool | str = False,
                 max_gen_toks: int | str = 256, seed: int | str = 1234, logits_cache: bool | str = True,
                 max_batch_size: int | str | None = None, **unknown: Any) -> None:
        super().__init__()
        if unknown:
            raise ConfigError(f"unknown model argument(s) {sorted(unknown)} for --model {MODEL_NAME}: use "
                              "pretrained, batch_size, max_length, max_gen_toks, device, dtype, loop_repeats, "
                              "exit_after, allow_other_tokenizer, seed, logits_cache")
        if pretrained is None:
            raise ConfigError(f"model argument `pretrained` is missing: pass --model_args pretrained=RUN (a run, "
                              f"checkpoint or export directory) with --model {MODEL_NAME}")
        run = load_run(str(pretrained), allow_other_tokenizer=_bool_opt("allow_other_tokenizer", allow_other_tokenizer))
        tokenizer, eot_id = run_tokenizer(run)
        self._setup(run.model, tokenizer, eot_id, str(run.export_dir), batch_size=batch_size, max_length=max_length,
                    device=device, dtype=dtype if dtype is not None else "float32", loop_repeats=loop_repeats,
                    exit_after=exit_after, max_gen_toks=max_gen_toks, seed=seed, logits_cache=logits_cache)

    @classmethod
    def from_model(cls, model: SmeltLM, tokenizer: Tokenizer, eot_id: int, **options: Any) -> SmeltHarnessLM:
        """Wrap an in-memory model (e.g. the one being trained) with the same options as the
        constructor except ``pretrained`` / ``allow_other_tokenizer``. ``device`` and ``dtype``
        default to the model's own (given, they move / cast the caller's model); the model's
        visit plan and train/eval mode are restored after every request method."""
        bad = sorted(set(options) - {"batch_size", "max_length", "device", "dtype", "loop_repeats", "exit_after",
                                     "max_gen_toks", "seed", "logits_cache", "export"})
        if bad:
            raise ConfigError(f"unknown option(s) {bad} of SmeltHarnessLM.from_model: use batch_size, max_length, "
                              "device, dtype, loop_repeats, exit_after, max_gen_toks, seed, logits_cache, export")
        self = cls.__new__(cls)
        TemplateLM.__init__(self)
        export = options.pop("export", None)
        self._setup(model, tokenizer, eot_id, None if export is None else str(export), **options)
        return self

    def _setup(self, model: SmeltLM, tokenizer: Tokenizer, eot_id: int, export: str | None, batch_size: Any = 8,
               max_length: Any = None, device: Any = None, dtype: Any = None, loop_repeats: Any = None,
               exit_after: Any = None, max_gen_toks: Any = 256, seed: Any = 1234, logits_cache: Any = True) -> None:
        if isinstance(batch_size, str) and batch_size.strip().lower().startswith("auto"):
            raise ConfigError(f"model argument `batch_size` ({batch_size!r}): automatic batch sizes are not "
                              "supported by --model smelt-ds: pass an integer, e.g. batch_size=8")
        self.model, self.tokenizer, self._eot_id, self.export = model, tokenizer, int(eot_id), export
        self._batch_size = _int_opt("batch_size", batch_size) or 8
        limit = model.model_cfg.max_seq_len
        self._max_length = _int_opt("max_length", max_length, minimum=2) or limit
        if self._max_length > limit:
            raise ConfigError(f"model argument `max_length` ({self._max_length}) exceeds `model.max_seq_len` "
                              f"({limit}) of the model: pass max_length <= {limit}")
        self._max_gen_toks = _int_opt("max_gen_toks", max_gen_toks) or 256
        given_seed = _int_opt("seed", seed, minimum=0)
        self.seed: int = 1234 if given_seed is None else given_seed
        self.logits_cache = _bool_opt("logits_cache", logits_cache)
        dev, dt = _device_opt(device), _dtype_opt(dtype)
        if dev is not None or dt is not None:
            model.to(device=dev, dtype=dt)
        self._device = device_of(model)  # where every request's tokens go (lm-eval's LM.device)
        self.loop_repeats, self.exit_after = _int_opt("loop_repeats", loop_repeats), _int_opt("exit_after", exit_after)
        self._loop: LoopConfig | None = None
        if self.loop_repeats is not None or self.exit_after is not None:
            # raises ConfigError for a model without loop ranges (a Baseline)
            self._loop = loop_with_repeats(model.loop_cfg, model.model_cfg.num_layers, self.loop_repeats,
                                           self.exit_after)
        self._truncation_warned = False

    # -- properties the harness reads --------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self._eot_id

    @property
    def prefix_token_id(self) -> int:
        return self._eot_id

    @property
    def max_length(self) -> int:
        """Tokens per forward window."""
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def loop_cfg(self) -> LoopConfig:
        """The loop section every request runs (the model's own without loop options)."""
        return self._loop if self._loop is not None else self.model.loop_cfg

    @property
    def visit_plan(self) -> list[int]:
        """Layer index of every visit of the plan the requests run (effective depth = length)."""
        return build_schedule(self.loop_cfg, self.model.model_cfg.num_layers).layers()

    @property
    def tokenizer_name(self) -> str:
        """Fingerprint of the tokenizer (the harness keys request caches by it)."""
        return f"smelt-ds-bpe-{self.tokenizer.get_vocab_size()}-{tokenizer_hash(self.tokenizer)[:16]}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """No chat template: the models are base LMs trained on plain documents."""
        return None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        raise ConfigError("--model smelt-ds has no chat template (a base LM trained on plain documents): run "
                          "without --apply_chat_template")

    def get_model_info(self) -> dict:
        """What the harness's results JSON records about the model (``config`` section)."""
        return {"smelt_export": self.export, "visit_plan": self.visit_plan, "visits": len(self.visit_plan),
                "loop_repeats": self.loop_repeats, "exit_after": self.exit_after,
                "non_embedding_params": self.model.num_non_embedding_params(),
                "model_dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
                "max_length": self.max_length, "tokenizer_name": self.tokenizer_name}

    # -- tokens -------------------------------------------------------------------------------
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """Token ids of ``string``, no special tokens added (``add_special_tokens`` is accepted for
        the harness's interface; the tokenizer has no template). ``left_truncate_len`` keeps the
        last that many ids."""
        ids = list(self.tokenizer.encode(string, add_special_tokens=False).ids)
        if left_truncate_len is not None:
            ids = ids[-left_truncate_len:]
        return ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    # -- running the model ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """Eval mode, no grad, the requested visit plan; the model's own plan and mode after."""
        m = self.model
        was_training = m.training
        old = m.set_loop(self._loop) if self._loop is not None else None
        m.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            if old is not None:
                m.set_loop(old)
            m.train(was_training)

    def _window(self, context_enc: list[int], continuation_enc: list[int]) -> list[int]:
        if not continuation_enc:
            raise ConfigError("a loglikelihood request has an empty continuation: the task's target must be "
                              "non-empty text")
        full = context_enc + continuation_enc
        if len(full) > self.max_length + 1 and not self._truncation_warned:
            log.warning("context + continuation (%d tokens) exceeds max_length (%d): the context is truncated "
                        "from the left (further truncations are not reported)", len(full), self.max_length)
            self._truncation_warned = True
        return full[-(self.max_length + 1):][:-1]

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        """``requests``: ``((context, continuation) | None, context_ids, continuation_ids)`` ->
        ``[(log-likelihood (nats), is_greedy)]`` in request order (see :func:`continuation_logprobs`
        and :func:`score_continuation`).

        A continuation longer than ``max_length`` (which one window cannot score; HFLM refuses it)
        is scored in consecutive pieces of ``max_length`` tokens, each read after the
        ``max_length`` tokens before it (context + the earlier continuation tokens): its
        log-likelihood is the sum of the pieces' in order, ``is_greedy`` holds when it holds for
        every piece."""
        L = self.max_length
        pieces: list[tuple[Any, list[int], list[int]]] = []
        owner: list[int] = []
        for i, (req_str, ctx, cont) in enumerate(requests):
            if len(cont) <= L:
                pieces.append((req_str, ctx, cont))
                owner.append(i)
                continue
            full = ctx + cont
            for start in range(len(ctx), len(full), L):
                pieces.append((None, full[:start], full[start:start + L]))
                owner.append(i)
        scored = self._score_pieces(pieces, disable_tqdm, override_bs)
        if len(pieces) == len(requests):
            return scored
        lls: list[float] = [0.0] * len(requests)
        greedy = [True] * len(requests)
        for i, (ll, g) in zip(owner, scored, strict=True):
            lls[i] += ll
            greedy[i] = greedy[i] and g
        out = list(zip(lls, greedy, strict=True))
        for (req_str, _, cont), answer in zip(requests, out, strict=True):
            if req_str is not None and len(cont) > L:
                self.cache_hook.add_partial("loglikelihood", req_str, answer)
        return out

    def _score_pieces(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool,
                      override_bs: int | None) -> list[tuple[float, bool]]:
        """HFLM's loop: longest first, batches of ``batch_size``, the one-token-continuation cache,
        results in request order. Continuations are at most ``max_length`` tokens."""
        from lm_eval.models.utils import Collator
        from tqdm import tqdm

        def by_length(req):  # longest first, as HFLM: the first row of a batch is its padded length
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        re_ord = Collator(requests, sort_fn=by_length, group_by="contexts" if self.logits_cache else None,
                          group_fn=lambda req: req[-2] + req[-1][:-1])
        res: list[tuple[float, bool]] = []
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")
        with self._running():
            for chunk in re_ord.get_batched(n=override_bs or self.batch_size):
                windows = [(self._window(ctx, cont), cont) for _, ctx, cont in chunk]
                logps = continuation_logprobs(self.model, windows, self._eot_id, self._device)
                for (request_str, ctx, cont), logp_CV in zip(chunk, logps, strict=True):
                    # the harness's one-token-continuation cache: every request whose
                    # context + continuation[:-1] equals this row's is scored on this row
                    for req_str, cont_toks, lp in re_ord.get_cache(req_str=request_str, cxt_toks=ctx,
                                                                   cont_toks=cont, logits=logp_CV[None]):
                        answer = score_continuation(lp[0], cont_toks)
                        res.append(answer)
                        if req_str is not None:
                            self.cache_hook.add_partial("loglikelihood", req_str, answer)
                        bar.update(1)
        bar.close()
        return re_ord.get_original(res)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood (nats) of each whole string: disjoint windows of ``max_length`` predicted
        tokens (``get_rolling_token_windows`` + ``make_disjoint_window``, context_len 1, the first
        window conditioned on end-of-text), summed over the string's windows in order."""
        from lm_eval import utils

        windows: list[tuple[None, list[int], list[int]]] = []
        counts = []
        for (string,) in [req.args for req in requests]:
            rolling = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows += [(None, ctx, cont) for ctx, cont in rolling]
            counts.append(len(rolling))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=True) if windows else []
        out, start = [], 0
        for req, n in zip(requests, counts, strict=True):
            total = sum(s[0] for s in scores[start:start + n])
            start += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Continuations of each context (see the module docstring): one call of
        :meth:`SmeltLM.generate` per run of equal-length contexts within a batch of requests with
        the same generation options; the text is cut at the first stop string."""
        from lm_eval.models.utils import Collator
        from tqdm import tqdm

        encoded: dict[str, list[int]] = {}

        def cached_encode(context: str) -> list[int]:
            if context not in encoded:
                encoded[context] = self.tok_encode(context)
            return encoded[context]

        re_ord = Collator([req.args for req in requests], sort_fn=lambda a: (-len(cached_encode(a[0])), a[0]),
                          group_by="gen_kwargs", group_fn=lambda a: a[1])
        generator = sampling_generator(self._device, self.seed)
        res: list[str] = []
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running generate_until requests")
        with self._running():
            for chunk in re_ord.get_batched(n=self.batch_size):
                opts = self._gen_options(chunk[0][1])
                ids = [self._gen_context(cached_encode(ctx), opts["max_gen_toks"]) for ctx, _ in chunk]
                i = 0
                while i < len(chunk):  # runs of equal length (the chunk is sorted by length)
                    j = i
                    while j < len(chunk) and len(ids[j]) == len(ids[i]):
                        j += 1
                    for (ctx, kw), text in zip(chunk[i:j], self._generate(ids[i:j], opts, generator), strict=True):
                        res.append(text)
                        self.cache_hook.add_partial("generate_until", (ctx, kw), text)
                        bar.update(1)
                    i = j
        bar.close()
        return re_ord.get_original(res)

    def _gen_options(self, gen_kwargs: dict) -> dict:
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        if not isinstance(gen_kwargs, dict):
            raise ConfigError(f"generate_until options ({gen_kwargs!r}) must be a dict (a task's generation_kwargs)")
        kw = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        sampling = bool(kw.get("do_sample")) and float(kw.get("temperature", 0.0)) > 0
        extra = sorted(set(kw) - GEN_KEYS)
        ignorable = set(extra) <= SAMPLING_ONLY_KEYS and not sampling
        if extra and not ignorable:
            raise ConfigError(f"generation option(s) {extra} of the task are not supported by --model smelt-ds: "
                              f"it honours {sorted(GEN_KEYS)} (remove the others from the task's generation_kwargs "
                              "or --gen_kwargs)")
        if extra:
            log.warning("greedy decoding ignores the sampling option(s) %s", extra)
        max_gen = int(kw["max_gen_toks"])
        if max_gen < 1 or max_gen >= self.max_length:
            raise ConfigError(f"`max_gen_toks` ({max_gen}) must be in [1, max_length ({self.max_length})): set the "
                              "task's generation_kwargs.max_gen_toks (or --gen_kwargs max_gen_toks=N) lower")
        top_p = float(kw.get("top_p", 1.0) if sampling else 1.0)
        if not 0 < top_p <= 1:
            raise ConfigError(f"generation option `top_p` ({top_p}) must be in (0, 1]")
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        return {"until": handle_stop_sequences(kw.get("until"), eos=eos), "max_gen_toks": max_gen,
                "temperature": float(kw.get("temperature", 0.0)) if sampling else 0.0, "top_p": top_p}

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """The harness's split (``TemplateLM._encode_pair``: trailing whitespace of the context moves
        to the continuation, the pair is encoded as one text) with end-of-text before the context:
        the model reads a request as the start of a document, as it was trained (documents follow
        end-of-text) and as ``smelt-ds generate`` and HumanEval prompt it
        (:func:`smelt_ds.eval.generation.encode_prompt`). An empty context is ``[eot]`` alone
        (``prefix_token_id``, as the harness does)."""
        ctx, cont = super()._encode_pair(context, continuation)
        return [self.prefix_token_id] + ctx, cont

    def _gen_context(self, ids: list[int], max_gen_toks: int) -> list[int]:
        """``[eot] + ids`` (a document start, see :meth:`_encode_pair`), left-truncated to leave
        ``max_gen_toks`` positions for the new tokens."""
        return ([self.prefix_token_id] + ids)[-(self.max_length - max_gen_toks):]

    def _generate(self, ids: list[list[int]], opts: dict, generator: torch.Generator) -> list[str]:
        """Decode rows of equal length ``(B, S)``; each row's new tokens up to its first
        end-of-text, as text cut at the first stop string."""
        from lm_eval.models.utils import postprocess_generated_text

        (batch,) = to_device(self._device, torch.tensor(ids, dtype=torch.long))
        until, eot = opts["until"], self.eot_token_id

        def every_row_stopped(new_BN: torch.Tensor) -> bool:
            # a row is finished once it holds end-of-text or, decoded, one of the stop strings
            return all(eot in row or any(u in self.tok_decode(row) for u in until) for row in new_BN.tolist())

        out = self.model.generate(batch, opts["max_gen_toks"], temperature=opts["temperature"], top_p=opts["top_p"],
                                  eos_token_id=eot, generator=generator, stop=every_row_stopped if until else None)
        texts = []
        for row in out[:, batch.shape[1]:].tolist():
            if self.eot_token_id in row:
                row = row[: row.index(self.eot_token_id)]
            texts.append(postprocess_generated_text(self.tok_decode(row), opts["until"], None))
        return texts


def run_tokenizer(run) -> tuple[Tokenizer, int]:
    """The tokenizer a loaded run is scored with and its end-of-text id: the export's recorded
    ``tokenizer.json`` (``data.tokenizer.path`` after :func:`load_run`), else the tokenizer of the
    recipe's prepared data (prepared on first use)."""
    tok_cfg = run.cfg.data.tokenizer
    if tok_cfg.path is not None:
        tok = load_tokenizer(tok_cfg.path, "data.tokenizer.path")
        return tok, special_ids(tok, tok_cfg)[0]
    data = open_eval_data(run.cfg)
    return data.tokenizer, data.eot_id


def register() -> None:
    """Register :class:`SmeltHarnessLM` as lm-eval model ``smelt-ds`` (idempotent). lm-eval's
    own models are registered first (their lazy placeholders), since the harness imports them
    only while its registry is empty."""
    import lm_eval.models  # noqa: F401  (MODEL_MAPPING placeholders)
    from lm_eval.api.registry import model_registry, register_model

    if MODEL_NAME in model_registry:
        current = model_registry.get(MODEL_NAME)
        if isinstance(current, type) and current.__name__ == SmeltHarnessLM.__name__:
            return  # this class, or its twin when this file runs as __main__
    register_model(MODEL_NAME)(SmeltHarnessLM)


# ---------------------------------------------------------------------------------------------
# running tasks in process
# ---------------------------------------------------------------------------------------------


_TASK_MANAGERS: dict[tuple[tuple[str, ...], bool], TaskManager] = {}


def _cached_manager(include_paths: tuple[str, ...], defaults: bool) -> TaskManager:
    from lm_eval.tasks import TaskManager

    key = (include_paths, defaults)
    if key not in _TASK_MANAGERS:
        _TASK_MANAGERS[key] = TaskManager(include_path=list(include_paths) or None, include_defaults=defaults)
    return _TASK_MANAGERS[key]


def task_manager(tasks: list[str], include_path: str | None = None) -> TaskManager:
    """A :class:`lm_eval.tasks.TaskManager` that knows ``tasks``, cached per include path.

    With ``include_path`` the directory alone is indexed first (lm-eval's own ~15k task files take
    about 20 s to index). Names of the offline benchmarks (:mod:`smelt_ds.eval.benchmarks`, group
    ``smelt_benchmarks``) that the directory does not hold add the fetched benchmarks' task
    directory (ConfigError naming the install command when they are not fetched). lm-eval's
    built-in tasks are indexed (once per process) only when a name is found in neither. Raises
    ConfigError naming the task names found nowhere."""
    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"`--include-path` ({include_path!r}) is not a directory: pass the directory holding "
                          "the task YAML files (e.g. the output of `smelt-ds eval build-tasks OUT`)")
    paths: tuple[str, ...] = () if include_path is None else (str(Path(include_path).resolve()),)
    own = _cached_manager(paths, False) if paths else None
    bench = tasks_dir_for([t for t in tasks if own is None or not own.match_tasks([t])])
    paths += () if bench is None else (bench,)
    local = _cached_manager(paths, False) if paths else None
    if local is not None and all(local.match_tasks([t]) for t in tasks):
        return local
    builtin = _cached_manager((), True)
    missing = [t for t in tasks if not builtin.match_tasks([t]) and not (local is not None and local.match_tasks([t]))]
    if missing:
        raise ConfigError(f"unknown harness task(s) {missing} (include path {include_path!r}): name tasks, groups "
                          "or tags of lm-eval or of the --include-path directory (`smelt-ds lm-eval ls tasks "
                          "--include_path DIR` lists them), or the offline benchmarks (`smelt-ds eval "
                          "fetch-benchmarks` lists them)")
    return builtin if not paths else _cached_manager(paths, True)


@contextlib.contextmanager
def _in_process_bootstrap() -> Iterator[None]:
    """lm-eval bootstraps stderrs in a process pool unless ``DISABLE_MULTIPROC`` is set; keep it
    in this process (no fork of a training process) for the duration of one evaluation."""
    old = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = old


def check_tasks(tasks) -> list[str]:
    if isinstance(tasks, str) or not tasks or not all(isinstance(t, str) and t.strip() for t in tasks):
        raise ConfigError(f"harness tasks ({tasks!r}) must be a non-empty list of task names, e.g. "
                          "['smelt_lambada_prose', 'smelt_nextline_code']")
    return [t.strip() for t in tasks]


def sorted_samples(samples: dict[str, list[int]] | None) -> dict[str, list[int]] | None:
    """lm-eval maps its 0..n-1 enumeration through each list: sorted, each document once."""
    return None if samples is None else {t: sorted(set(map(int, v))) for t, v in samples.items()}



def run_harness(lm: SmeltHarnessLM, tasks: list[str], include_path: str | None = None, num_fewshot: int | None = None,
                limit: int | None = None, log_samples: bool = False, seed: int = 1234,
                bootstrap_iters: int = BOOTSTRAP_ITERS, samples: dict[str, list[int]] | None = None) -> dict:
    """:func:`lm_eval.simple_evaluate` of ``lm`` on ``tasks`` (names, groups or tags).

    ``num_fewshot`` k overrides the tasks' own (None: theirs, else 0); ``limit`` caps the
    examples per task (the first ``limit`` documents); ``samples`` instead names the documents
    (``{task: [doc index, ...]}``, lm-eval's ``samples``, e.g. from :func:`spread_samples`). Every
    seed of the harness (Python, NumPy, torch, few-shot sampler) and the model's sampling seed are
    set from ``seed``, so repeated calls give the same numbers. Stderrs of non-mean metrics use
    ``bootstrap_iters`` resamples, in this process. Returns the harness's results dict
    (``results``, ``groups``, ``configs``, ``n-shot``, ``n-samples``, ``config``, ``samples`` when
    ``log_samples``)."""
    import lm_eval.evaluator

    names = check_tasks(tasks)
    if num_fewshot is not None and num_fewshot < 0:
        raise ConfigError(f"`--num-fewshot` ({num_fewshot}) must be >= 0")
    if limit is not None and limit < 1:
        raise ConfigError(f"`--limit` ({limit}) must be >= 1 examples per task")
    if limit is not None and samples is not None:
        raise ConfigError("`--limit` and `--samples-per-task` both choose the documents: pass one of them")
    samples = sorted_samples(samples)
    tm = task_manager(names, include_path)
    lm.seed = seed
    with _in_process_bootstrap(), downloads_named(names):
        results = lm_eval.evaluator.simple_evaluate(
            model=lm, tasks=names, num_fewshot=num_fewshot, limit=limit, samples=samples, log_samples=log_samples,
            task_manager=tm, bootstrap_iters=bootstrap_iters, random_seed=seed, numpy_random_seed=seed,
            torch_random_seed=seed, fewshot_random_seed=seed)
    assert results is not None  # rank 0 of one process
    return dict(results)


def evaluate_model(model: SmeltLM, tokenizer: Tokenizer, eot_id: int, tasks: list[str], include_path: str | None = None,
                   num_fewshot: int | None = None, limit: int | None = None, batch_size: int = 8,
                   log_samples: bool = False, seed: int = 1234) -> dict:
    """Harness tasks on an in-memory model (``smelt-ds eval --harness``, in-loop evaluation).

    ``model``: a :class:`smelt_ds.model.SmeltLM` (its plan and train/eval mode are restored
    afterwards); ``tokenizer``: the ``tokenizers.Tokenizer`` it was trained with; ``eot_id``:
    its end-of-text id. See :func:`run_harness` for the other arguments and the result."""
    lm = SmeltHarnessLM.from_model(model, tokenizer, eot_id, batch_size=batch_size, seed=seed)
    return run_harness(lm, tasks, include_path, num_fewshot, limit, log_samples, seed)


# ---------------------------------------------------------------------------------------------
# lm-eval's own command line with the model registered
# ---------------------------------------------------------------------------------------------


def run_lm_eval(argv: list[str]) -> int:
    """lm-eval's command line (``lm_eval.__main__.cli_evaluate``, which reads ``sys.argv``) with
    ``argv`` unchanged, after :func:`register`. Returns its exit status."""
    from lm_eval.__main__ import cli_evaluate

    register()
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as e:  # argparse --help / errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m smelt_ds.eval.harness <lm-eval arguments>``; bad configuration is one line on
    stderr and exit status 2 (as in ``smelt-ds``)."""
    try:
        return run_lm_eval(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as e:
        print(f"python -m smelt_ds.eval.harness: error: {e}", file=sys.stderr)
        return 2


register()

if __name__ == "__main__":
    sys.exit(main())
