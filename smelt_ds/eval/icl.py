"""In-context learning curves: loss and accuracy on answer tokens vs the number of in-context
examples k.

Every episode is a token sequence ``[end-of-text] + k examples + query + answer``; only the
answer tokens are scored (teacher forcing):

- **loss** (nats/token): mean cross-entropy over all answer tokens of all episodes;
- **accuracy**: share of episodes whose every answer token is the model's argmax (exact match);
- **token_accuracy**: share of answer tokens that are the argmax.

Episodes are nested in k: episode ``e`` draws its examples once (seeded by the seed, the task
name and ``e``) and the k-shot version keeps the first k, so the curves compare the same queries
at every k. The leading end-of-text token is the document separator the models were trained
with. A k whose longest episode does not fit the context (``max_len`` tokens) is skipped, not
truncated.

Tasks (construction):

Synthetic (need the context; built from single-token words of the tokenizer, i.e. tokens that
are a space and 3-8 lowercase letters):

- ``kv_recall``: a fresh random mapping of ``n_keys`` (4) key words to value words per episode;
  k lines `` key -> value`` drawn with replacement from the mapping, then `` key ->`` for a
  random key; answer: its value (1 token). Chance before the key was shown, so accuracy grows
  with k as the mapping is covered (P(query shown) = 1 - (1 - 1/n_keys)^k).
- ``pattern``: a random sequence of ``length`` (6) words, shown k times (one line each); answer:
  the next repetition (``length`` tokens). k = 0 is unpredictable words; from k = 1 on the answer
  can be copied (induction).

From the evaluation data (the validation split of the run's prepared data):

- ``word_case``: lowercase words (4-9 letters) found in the validation text; examples
  ``word -> WORD`` one per line; query ``word ->``; answer `` WORD`` (the mapping is only given
  by the examples).
- ``complete_<domain>``: lines (24-100 characters, leading whitespace removed) of the domain's
  validation documents; k random lines as context, then the first half of another line (cut at
  the space nearest its middle); answer: the rest of that line. Measures how much in-domain
  context helps completion (code vs text).
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from smelt_ds.errors import ConfigError
from smelt_ds.parallel.device import device_of, to_device

__all__ = ["Episode", "ICLTask", "KVRecallTask", "PatternTask", "WordCaseTask", "LineCompletionTask",
           "word_token_ids", "build_tasks", "episode_batch", "score_episodes", "evaluate_task", "parse_shots",
           "DEFAULT_SHOTS", "TASK_NAMES"]

DEFAULT_SHOTS = (0, 1, 2, 4, 8, 16)
TASK_NAMES = ("kv_recall", "pattern", "word_case", "complete")
MAX_SHOTS = 64
MIN_ITEMS = MAX_SHOTS + 1  # distinct words / lines a data task needs: 64 examples + the query


@dataclass(frozen=True)
class Episode:
    """``tokens`` = prompt + answer (ids); the answer is ``tokens[answer_start:answer_start + answer_len]``."""

    tokens: tuple[int, ...]
    answer_start: int
    answer_len: int


def _rng(seed: int, name: str, e: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(name.encode()), e]))


def _token_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def word_token_ids(tokenizer) -> list[int]:
    """Ids of tokens that are one space plus 3-8 lowercase ASCII letters (byte-level ``Ġword``)."""
    out = []
    for i in range(tokenizer.get_vocab_size()):
        t = tokenizer.id_to_token(i)
        if t and re.fullmatch(r"Ġ[a-z]{3,8}", t):
            out.append(i)
    return out


@dataclass
class ICLTask:
    """A family of episodes. ``episode(e, k)`` builds episode ``e`` with k in-context examples."""

    name: str
    kind: str  # "synthetic" or "data"
    description: str
    eot_id: int
    seed: int = 0

    def episode(self, e: int, k: int) -> Episode:
        raise NotImplementedError

    def _assemble(self, examples: list[list[int]], query: list[int], answer: list[int]) -> Episode:
        prompt = [self.eot_id] + [t for ex in examples for t in ex] + query
        return Episode(tuple(prompt + answer), len(prompt), len(answer))


@dataclass
class KVRecallTask(ICLTask):
    words: list[int] = field(default_factory=list)
    arrow: list[int] = field(default_factory=list)
    newline: list[int] = field(default_factory=list)
    n_keys: int = 4
    max_k: int = MAX_SHOTS

    def episode(self, e: int, k: int) -> Episode:
        rng = _rng(self.seed, self.name, e)
        w = rng.choice(self.words, 2 * self.n_keys, replace=False).tolist()
        keys, vals = w[:self.n_keys], w[self.n_keys:]
        shown = rng.integers(0, self.n_keys, size=self.max_k).tolist()
        q = int(rng.integers(0, self.n_keys))
        examples = [[keys[i], *self.arrow, vals[i], *self.newline] for i in shown[:k]]
        return self._assemble(examples, [keys[q], *self.arrow], [vals[q]])


@dataclass
class PatternTask(ICLTask):
    words: list[int] = field(default_factory=list)
    newline: list[int] = field(default_factory=list)
    length: int = 6

    def episode(self, e: int, k: int) -> Episode:
        rng = _rng(self.seed, self.name, e)
        pattern = rng.choice(self.words, self.length, replace=False).tolist()
        return self._assemble([pattern + self.newline] * k, [], pattern)


@dataclass
class WordCaseTask(ICLTask):
    tokenizer: object = None
    words: list[str] = field(default_factory=list)
    max_k: int = MAX_SHOTS

    def episode(self, e: int, k: int) -> Episode:
        rng = _rng(self.seed, self.name, e)
        picked = rng.choice(len(self.words), min(self.max_k + 1, len(self.words)), replace=False).tolist()
        q = self.words[picked[-1]]
        examples = [_token_ids(self.tokenizer, f"{self.words[i]} -> {self.words[i].upper()}\n") for i in picked[:k]]
        return self._assemble(examples, _token_ids(self.tokenizer, f"{q} ->"),
                              _token_ids(self.tokenizer, f" {q.upper()}"))


def _middle_space(line: str) -> int | None:
    """Index of the space nearest the middle of ``line`` with non-space characters on both sides."""
    cands = [i for i in range(1, len(line) - 1) if line[i] == " " and line[i - 1] != " " and line[i + 1] != " "]
    return min(cands, key=lambda i: abs(i - len(line) / 2)) if cands else None


@dataclass
class LineCompletionTask(ICLTask):
    tokenizer: object = None
    lines: list[str] = field(default_factory=list)
    max_k: int = MAX_SHOTS

    def episode(self, e: int, k: int) -> Episode:
        rng = _rng(self.seed, self.name, e)
        picked = rng.choice(len(self.lines), min(self.max_k + 1, len(self.lines)), replace=False).tolist()
        q = self.lines[picked[-1]]
        c = _middle_space(q)
        examples = [_token_ids(self.tokenizer, self.lines[i] + "\n") for i in picked[:k]]
        return self._assemble(examples, _token_ids(self.tokenizer, q[:c]), _token_ids(self.tokenizer, q[c:]))


def _words_from_text(text: str) -> list[str]:
    return sorted(set(re.findall(r"(?<![A-Za-z0-9_])[a-z]{4,9}(?![A-Za-z0-9_])", text)))


def _lines_from_text(text: str) -> list[str]:
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if 24 <= len(line) <= 100 and _middle_space(line) is not None:
            out.append(line)
    return sorted(set(out))


def check_task_names(names: tuple[str, ...]) -> None:
    """Raises ConfigError naming ``--tasks`` when a name is not in :data:`TASK_NAMES`."""
    unknown = [n for n in names if n not in TASK_NAMES]
    if unknown:
        raise ConfigError(f"`--tasks` ({','.join(names)}) names unknown task(s) {unknown}: choose from "
                          f"{','.join(TASK_NAMES)}")


def build_tasks(data, names: tuple[str, ...] = TASK_NAMES, seed: int = 0, text_tokens: int = 200_000) -> list[ICLTask]:
    """The tasks ``names`` for a run's :class:`smelt_ds.eval.data.EvalData` (``complete`` expands
    to one ``complete_<domain>`` per validation domain). Raises ConfigError for an unknown name
    or a tokenizer/data too small to build a task from."""
    check_task_names(names)
    tok, eot = data.tokenizer, data.eot_id
    tasks: list[ICLTask] = []
    if "kv_recall" in names or "pattern" in names:
        words = word_token_ids(tok)
        if len(words) < 16:
            raise ConfigError(f"the tokenizer has {len(words)} single-token words (space + 3-8 lowercase letters), "
                              "the synthetic tasks need >= 16: drop kv_recall and pattern from --tasks or use a "
                              "larger vocabulary")
        nl = _token_ids(tok, "\n")
        if "kv_recall" in names:
            tasks.append(KVRecallTask("kv_recall", "synthetic", "key-value recall, 4 random keys per episode",
                                      eot, seed, words=words, arrow=_token_ids(tok, " ->"), newline=nl))
        if "pattern" in names:
            tasks.append(PatternTask("pattern", "synthetic", "continue a 6-word pattern shown k times", eot, seed,
                                     words=words, newline=nl))
    texts = {d: data.text_of(d, text_tokens) for d in data.domains} if {"word_case", "complete"} & set(names) else {}
    if "word_case" in names:
        words_s = _words_from_text("\n".join(texts.values()))
        if len(words_s) < MIN_ITEMS:
            raise ConfigError(f"validation text holds {len(words_s)} distinct lowercase words, word_case needs "
                              f">= {MIN_ITEMS}: drop it from --tasks or raise data.validation_share")
        tasks.append(WordCaseTask("word_case", "data", "word -> WORD, words from the validation text", eot, seed,
                                  tokenizer=tok, words=words_s))
    if "complete" in names:
        for d in data.domains:
            lines = _lines_from_text(texts[d])
            if len(lines) >= MIN_ITEMS:  # else too few lines: the domain gets no task
                tasks.append(LineCompletionTask(f"complete_{d}", "data",
                                                f"complete a {d} line after k {d} lines", eot, seed,
                                                tokenizer=tok, lines=lines))
    return tasks


def parse_shots(text: str | None) -> tuple[int, ...]:
    """``"0,1,2,4"`` -> ``(0, 1, 2, 4)`` (numbers of in-context examples). Raises ConfigError."""
    if text is None:
        return DEFAULT_SHOTS
    try:
        shots = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ConfigError(f"`--shots` ({text!r}) must be comma-separated integers >= 0, e.g. 0,1,2,4,8") from None
    if not shots or shots[0] < 0 or shots[-1] > MAX_SHOTS:
        raise ConfigError(f"`--shots` ({text!r}) must list integers in [0, 64], e.g. 0,1,2,4,8")
    return shots


def episode_batch(episodes: list[Episode], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``labels`` ``(N, T - 1)``: right-padded with ``pad_id`` (causal attention
    keeps padding out of every scored position); labels are -100 except on answer tokens."""
    T = max(len(ep.tokens) for ep in episodes)
    ids = torch.full((len(episodes), T), pad_id, dtype=torch.long)
    labels = torch.full((len(episodes), T), -100, dtype=torch.long)
    for i, ep in enumerate(episodes):
        ids[i, :len(ep.tokens)] = torch.tensor(ep.tokens)
        a, n = ep.answer_start, ep.answer_len
        labels[i, a:a + n] = ids[i, a:a + n]
    return ids[:, :-1], labels[:, 1:]


@torch.no_grad()
def score_episodes(model, episodes: list[Episode], pad_id: int, batch_size: int = 16) -> dict:
    """Sum over episodes: ``nats``, ``tokens`` (answer tokens), ``correct_tokens``,
    ``exact`` (episodes with every answer token the argmax), ``episodes``."""
    out = {"nats": 0.0, "tokens": 0, "correct_tokens": 0, "exact": 0, "episodes": len(episodes)}
    for i in range(0, len(episodes), batch_size):
        ids, labels = to_device(device_of(model), *episode_batch(episodes[i:i + batch_size], pad_id))
        logits = model(ids).logits.float()
        mask = labels != -100
        nll = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        hit = (logits.argmax(-1) == labels) & mask
        out["nats"] += float(nll.double().sum())
        out["tokens"] += int(mask.sum())
        out["correct_tokens"] += int(hit.sum())
        out["exact"] += int((hit.sum(1) == mask.sum(1)).sum())
    return out


def evaluate_task(model, task: ICLTask, shots: tuple[int, ...], episodes: int, max_len: int, pad_id: int) -> dict:
    """``{k: {"loss", "accuracy", "token_accuracy", "episodes", "answer_tokens"} | None}``; None when
    an episode with k examples is longer than ``max_len`` tokens (the context)."""
    out: dict[int, dict | None] = {}
    for k in shots:
        eps = [task.episode(e, k) for e in range(episodes)]
        if max(len(ep.tokens) for ep in eps) - 1 > max_len:
            out[k] = None
            continue
        s = score_episodes(model, eps, pad_id)
        out[k] = {"loss": s["nats"] / s["tokens"], "accuracy": s["exact"] / s["episodes"],
                  "token_accuracy": s["correct_tokens"] / s["tokens"], "episodes": s["episodes"],
                  "answer_tokens": s["tokens"]}
    return out
