"""Mechanism analysis per ``(layer, visit)``: attention sink, routing, logit lens.

All statistics are accumulated over validation micro-batches ``input_ids``/``labels`` ``(B, S)``
in one forward pass each (``SmeltLM.forward`` with ``probs_hook`` and ``visit_hook``).

**Attention** (per visit and query head; probabilities ``p`` ``(B, Nq, S, S)`` from the
``probs_hook``). Averages run over every batch row and every query position ``i >= 1`` (query 0
can only attend to itself, so it says nothing), i.e. ``B * (S - 1)`` rows per batch:

- ``first_mass``: ``p[i, 0]``, the attention sink (mass on the first token; Xiao et al. 2023,
  StreamingLLM; the SMELT paper's claim is that the second visit lowers it);
- ``self_mass``: ``p[i, i]``; ``content_mass``: ``sum_{0 < j < i} p[i, j]`` (earlier tokens other
  than the first), so ``first + self + content = 1``;
- ``top_mass``: sum of the ``top_m`` (3) largest ``p[i, j]`` of the row (concentration);
- ``entropy``: ``-sum_j p[i, j] ln p[i, j]`` (nats; ``ln(i + 1)`` for uniform attention);
- ``top_positions``: the ``top_m`` key positions receiving the largest share of all the head's
  attention mass (``sum_{b, i} p[b, i, j] / rows``), with that share.

**Routing** (MoE visits, from ``model.recorder``): ``load`` = share of the T*K routed token
copies per expert, ``load_max_over_mean`` (1 = balanced), and between consecutive visits of a
looped layer the **routing divergence** = share of tokens whose top-k expert *set* differs
(:func:`smelt_ds.model.lm.routing_divergence`; arXiv 2605.09165) and ``overlap`` = mean share of a
token's K experts kept.

**Logit lens** (nostalgebraist 2020): the model's own final norm and output head applied to the
residual stream after every visit (depth d = visits run; depth 0 is the token embedding):
``loss`` (nats/token against the labels), ``accuracy`` (argmax = label) and ``agree_final``
(argmax = the full model's argmax). At the last visit this is the model's own output, so its
loss equals ``lm_loss``. Loop **boundaries** (entry of a looped block, end of each of its
repeats in block order) are marked as early-exit candidates with their loss gap to the final.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from smelt_ds.eval.stratified import paired_difference
from smelt_ds.model.looping import Visit
from smelt_ds.parallel.device import device_of, to_device

__all__ = ["AttentionStats", "RoutingStats", "LogitLens", "loop_boundaries", "analyze_model"]


def _visit_key(v: Visit) -> str:
    return f"L{v.layer}V{v.visit}"


@dataclass
class AttentionStats:
    """Sums per visit of the per-row attention statistics (see the module docstring)."""

    top_m: int = 3
    sums: dict = field(default_factory=lambda: defaultdict(dict))
    rows: dict = field(default_factory=lambda: defaultdict(int))
    #: Visit -> [(B,) first-token mass per window: the mean over its heads and query rows], per batch
    window_first: dict = field(default_factory=lambda: defaultdict(list))

    def hook(self, visit: Visit, probs: torch.Tensor) -> None:
        """``probs_hook`` for ``SmeltLM.forward``: ``probs`` ``(B, Nq, S, P+S)`` with ``P = 0``."""
        p = probs.detach().float()[:, :, 1:, :]  # rows i >= 1: (B, Nq, S-1, S)
        if p.shape[2] == 0:
            return
        first = p[..., 0]
        self_ = torch.diagonal(p, offset=1, dim1=-2, dim2=-1)  # row r is query r + 1
        content = p[..., 1:].sum(-1) - self_
        top = p.topk(min(self.top_m, p.shape[-1]), dim=-1).values.sum(-1)
        ent = -torch.special.xlogy(p, p).sum(-1)
        stats = {"first_mass": first, "self_mass": self_, "content_mass": content, "top_mass": top, "entropy": ent}
        acc = self.sums[visit]
        for name, t in stats.items():
            acc[name] = acc.get(name, 0) + t.double().sum(dim=(0, 2))  # (Nq,)
        self.window_first[visit].append(first.double().mean(dim=(1, 2)))  # (B,)
        received = p.double().sum(dim=(0, 2))  # (Nq, S)
        acc["received"] = acc["received"] + received if "received" in acc else received
        self.rows[visit] += p.shape[0] * p.shape[2]

    def result(self, plan: list[Visit]) -> dict:
        """``{"L{l}V{v}": {"layer", "visit", "plan_index", stat: [per head], "mean": {stat: float},
        "top_positions": [[[pos, share], ...] per head]}}`` in visit-plan order."""
        out = {}
        for i, v in enumerate(plan):
            if v not in self.sums:
                continue
            acc, n = self.sums[v], self.rows[v]
            rec = {"layer": v.layer, "visit": v.visit, "plan_index": i, "rows": n}
            for name in ("first_mass", "self_mass", "content_mass", "top_mass", "entropy"):
                vals = (acc[name] / n).tolist()
                rec[name] = vals
            rec["mean"] = {name: sum(rec[name]) / len(rec[name])
                           for name in ("first_mass", "self_mass", "content_mass", "top_mass", "entropy")}
            share = acc["received"] / n  # (Nq, S)
            top = share.topk(min(self.top_m, share.shape[-1]), dim=-1)
            rec["top_positions"] = [[[int(j), float(s)] for j, s in zip(idx.tolist(), val.tolist(), strict=True)]
                                    for idx, val in zip(top.indices, top.values, strict=True)]
            out[_visit_key(v)] = rec
        return out


def compare_visits(attn: dict, plan: list[Visit], window_first: dict | None = None, seed: int = 0) -> list[dict]:
    """First vs later visits of each looped layer: per visit the head-mean ``first_mass``,
    ``content_mass``, ``entropy``, and ``delta_*`` = last visit minus first visit.

    With ``window_first`` (:attr:`AttentionStats.window_first`), ``delta_first_mass_interval`` is
    the paired comparison over validation windows of the last visit's first-token mass with the
    first visit's (:func:`smelt_ds.eval.stratified.paired_difference`: the mean of the per-window
    differences, which equals ``delta_first_mass`` since every window has the same rows, and its
    paired bootstrap 95% interval, BCa, seeded with ``seed``): whether the second visit's
    sink differs from the first's by more than window-to-window noise."""

    by_layer: dict[int, list[Visit]] = defaultdict(list)
    for v in plan:
        by_layer[v.layer].append(v)
    out = []
    for layer, visits in sorted(by_layer.items()):
        if len(visits) < 2 or any(_visit_key(v) not in attn for v in visits):
            continue
        rec = {"layer": layer, "visits": [v.visit for v in visits]}
        for name in ("first_mass", "content_mass", "entropy"):
            vals = [attn[_visit_key(v)]["mean"][name] for v in visits]
            rec[name] = vals
            rec[f"delta_{name}"] = vals[-1] - vals[0]
            rec[f"{name}_per_head"] = [attn[_visit_key(v)][name] for v in visits]
        if window_first is not None and all(window_first.get(v) for v in (visits[0], visits[-1])):
            last, first = (torch.cat(window_first[v]).tolist() for v in (visits[-1], visits[0]))
            rec["delta_first_mass_interval"] = paired_difference(last, first, seed=seed)
        out.append(rec)
    return out


@dataclass
class RoutingStats:
    """Expert counts per MoE visit and visit-to-visit routing changes, summed over batches."""

    counts: dict = field(default_factory=dict)  # Visit -> (E,) routed copies
    tokens: dict = field(default_factory=lambda: defaultdict(int))
    changed: dict = field(default_factory=lambda: defaultdict(float))  # (layer, a, b) -> tokens changed
    kept: dict = field(default_factory=lambda: defaultdict(float))  # (layer, a, b) -> sum of kept shares
    pair_tokens: dict = field(default_factory=lambda: defaultdict(int))
    #: (layer, a, b) -> [(B,) share of each window's tokens whose expert set changed], per batch
    window_changed: dict = field(default_factory=lambda: defaultdict(list))

    def add(self, recorder, windows: int = 1) -> None:
        """Accumulate the routes of the last forward pass (``model.recorder.routes``) of a batch of
        ``windows`` sequences (its T routed tokens in row-major ``(windows, T / windows)`` order)."""
        for v, r in recorder.routes.items():
            E = r.logits_TE.shape[-1]
            c = torch.bincount(r.topk_idx_TK.reshape(-1), minlength=E).double()
            self.counts[v] = self.counts[v] + c if v in self.counts else c
            self.tokens[v] += r.topk_idx_TK.shape[0]
        for v, r in recorder.routes.items():
            nxt = Visit(v.layer, v.visit + 1)
            if nxt not in recorder.routes:
                continue
            a, b = r.topk_idx_TK, recorder.routes[nxt].topk_idx_TK
            key = (v.layer, v.visit, nxt.visit)
            sa, sb = a.sort(-1).values, b.sort(-1).values
            changed = (sa != sb).any(-1)  # (T,)
            self.changed[key] += float(changed.sum())
            self.window_changed[key].append(changed.double().view(windows, -1).mean(-1))
            kept = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).double().mean(-1)  # (T,) share of experts kept
            self.kept[key] += float(kept.sum())
            self.pair_tokens[key] += a.shape[0]

    def result(self, plan: list[Visit]) -> dict:
        visits = {}
        for i, v in enumerate(plan):
            if v not in self.counts:
                continue
            c = self.counts[v]
            share = c / c.sum()
            visits[_visit_key(v)] = {"layer": v.layer, "visit": v.visit, "plan_index": i, "tokens": self.tokens[v],
                                     "load": share.tolist(), "load_max_over_mean": float(c.max() / c.mean())}
        div = [{"layer": pair[0], "visits": [pair[1], pair[2]],
                "divergence": self.changed[pair] / self.pair_tokens[pair],
                "overlap": self.kept[pair] / self.pair_tokens[pair], "tokens": self.pair_tokens[pair],
                "divergence_interval": self._interval(pair)}
               for pair in sorted(self.pair_tokens)]
        return {"visits": visits, "divergence": div}

    def _interval(self, pair) -> dict:
        """The mean over windows of the per-window divergence (= ``divergence``: windows have equal
        tokens) with its bootstrap 95% interval (BCa; :func:`smelt_ds.eval.stratified.paired_difference`
        against 0)."""
        values = torch.cat(self.window_changed[pair]).tolist()
        return paired_difference(values, [0.0] * len(values))


def loop_boundaries(schedule) -> list[dict]:
    """Early-exit candidates of a loop schedule: ``{"depth", "label"}`` where depth = visits run.

    For each loop range ``[a, b)``: its entry (before the first visit) and, in block order, the
    end of every repeat; in layer order only the end of the range.
    """
    plan = schedule.plan
    out = []
    for s in schedule.spans:
        entry = plan.index(Visit(s.start, 0))
        out.append({"depth": entry, "label": f"before loop [{s.start},{s.end})"})
        reps = range(s.repeats) if schedule.order == "block" else [s.repeats - 1]
        for r in reps:
            last = plan.index(Visit(s.end - 1, r))
            out.append({"depth": last + 1, "label": f"after repeat {r + 1} of loop [{s.start},{s.end})"})
    return out


@dataclass
class LogitLens:
    """Sums per depth (0 = embedding, d = after visit d of the plan) of lens loss and hits."""

    nats: dict = field(default_factory=lambda: defaultdict(float))
    correct: dict = field(default_factory=lambda: defaultdict(int))
    agree: dict = field(default_factory=lambda: defaultdict(int))
    tokens: int = 0

    def run(self, model, input_ids: torch.Tensor, labels: torch.Tensor, **forward_kwargs):
        """One forward (with ``labels``, so ``lm_loss`` is set) with the lens attached; returns the
        model output. ``input_ids`` and ``labels`` (CPU) go to the model's device
        (:func:`~smelt_ds.parallel.device.to_device`); the lens's sums are read back from there."""
        input_ids, labels = to_device(device_of(model), input_ids, labels)
        argmax: dict[int, torch.Tensor] = {}
        mask = labels != -100
        depth = [0]

        def lens(x: torch.Tensor) -> None:
            logits = model.lm_head(model.norm(x)).float()
            d = depth[0]
            nll = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
            self.nats[d] += float(nll.double().sum())
            am = logits.argmax(-1)
            self.correct[d] += int(((am == labels) & mask).sum())
            argmax[d] = am
            depth[0] += 1

        def visit_hook(visit: Visit, x: torch.Tensor) -> None:
            lens(x)

        lens(model.embed_tokens(input_ids))
        out = model(input_ids, labels=labels, visit_hook=visit_hook, **forward_kwargs)
        final = out.logits.argmax(-1)
        for d, am in argmax.items():
            self.agree[d] += int(((am == final) & mask).sum())
        self.tokens += int(mask.sum())
        return out

    def result(self, schedule) -> dict:
        plan = schedule.plan
        rows = []
        for d in sorted(self.nats):
            v = plan[d - 1] if d else None
            rows.append({"depth": d, "label": "embedding" if v is None else _visit_key(v),
                         "layer": None if v is None else v.layer, "visit": None if v is None else v.visit,
                         "loss": self.nats[d] / self.tokens, "accuracy": self.correct[d] / self.tokens,
                         "agree_final": self.agree[d] / self.tokens})
        final = rows[-1]["loss"]
        bounds = []
        for b in loop_boundaries(schedule):
            r = rows[b["depth"]]
            bounds.append({**b, "loss": r["loss"], "loss_gap_to_final": r["loss"] - final,
                           "agree_final": r["agree_final"]})
        return {"depths": rows, "boundaries": bounds, "final_loss": final}


@torch.no_grad()
def analyze_model(model, batches: list[dict], top_m: int = 3) -> dict:
    """Attention, routing and logit-lens statistics of ``model`` over ``batches``.

    Returns ``{"attention": ..., "attention_visits": ..., "routing": ..., "logit_lens": ...,
    "lm_loss": nats/token}`` (see :class:`AttentionStats`, :func:`compare_visits`,
    :class:`RoutingStats`, :class:`LogitLens`).
    """
    model.eval()
    attn, routing, lens = AttentionStats(top_m), RoutingStats(), LogitLens()
    nats, toks = 0.0, 0
    for b in batches:
        out = lens.run(model, b["input_ids"], b["labels"], probs_hook=attn.hook)
        n = int((b["labels"] != -100).sum())
        nats, toks = nats + float(out.lm_loss) * n, toks + n
        routing.add(model.recorder, windows=b["input_ids"].shape[0])
    plan = model.schedule.plan
    a = attn.result(plan)
    return {"attention": a, "attention_visits": compare_visits(a, plan, attn.window_first),
            "routing": routing.result(plan),
            "logit_lens": lens.result(model.schedule), "lm_loss": nats / toks if toks else float("nan")}
