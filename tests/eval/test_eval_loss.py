"""Per-domain loss, bits per byte and loss by position against direct computations."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from smelt_ds.errors import ConfigError


def _loaded(path):
    from smelt_ds.runs.load import load_run

    return load_run(path)


def _hand_batches(data, domain, seq_len, mb, n):
    from smelt_ds.data.loader import ValidationLoader

    vl = ValidationLoader(data.prepared, domain, seq_len, mb, dp_rank=0, dp_world_size=1)
    return list(itertools.islice(vl, n))


def test_position_buckets():
    from smelt_ds.eval.loss import parse_buckets, position_buckets

    assert position_buckets(128) == [(1, 8), (9, 16), (17, 32), (33, 64), (65, 128)]
    assert position_buckets(100, [64, 256]) == [(1, 64), (65, 100)]
    assert position_buckets(2048, [64, 256, 1024]) == [(1, 64), (65, 256), (257, 1024), (1025, 2048)]
    assert parse_buckets("64, 256") == [64, 256]
    for bad in ("a,b", "0,64", ""):
        with pytest.raises(ConfigError, match="--buckets"):
            parse_buckets(bad)


def test_token_byte_lengths_match_decoding(eval_data):
    tok = eval_data.tokenizer
    bl = eval_data.byte_lengths
    assert bl.shape == (tok.get_vocab_size(),)
    assert bl[eval_data.eot_id] == 0 and bl[eval_data.prepared.pad_id] == 0
    for i in range(2, tok.get_vocab_size()):
        text = tok.decode([i])
        if "\ufffd" not in text:  # whole characters: decoding gives the same bytes
            assert bl[i] == len(text.encode("utf-8")), (i, tok.id_to_token(i))
        else:
            assert 1 <= bl[i] <= 4 * len(tok.id_to_token(i))


def test_domain_loss_bits_per_byte_and_positions_match_hand_loop(random_exports, eval_data):
    from smelt_ds.eval.suite import EvalSettings, evaluate_runs

    run = _loaded(random_exports["smelt"])
    S, mb, nb = 32, 4, 3
    res = evaluate_runs([run], EvalSettings(seq_len=S, micro_batch_size=mb, batches=nb, tasks=()), log=lambda *_: None)
    per = res["domains"][run.name]
    assert set(per) == {*eval_data.domains, "all"} == {"code", "text", "all"}
    model = run.model
    tot = {"nats": 0.0, "tok": 0, "bytes": 0}
    dom_loss, dom_bpb = [], []
    for dom in eval_data.domains:
        batches = _hand_batches(eval_data, dom, S, mb, nb)
        num = den = 0.0
        pos_n, pos_t = torch.zeros(S, dtype=torch.float64), torch.zeros(S, dtype=torch.float64)
        labels_stream = []
        with torch.no_grad():
            for b in batches:
                out = model(b["input_ids"], labels=b["labels"])
                n = b["labels"].numel()
                num, den = num + float(out.lm_loss) * n, den + n
                ce = F.cross_entropy(out.logits.transpose(1, 2), b["labels"], reduction="none").double()
                pos_n += ce.sum(0)
                pos_t += ce.shape[0]
                labels_stream += b["labels"].reshape(-1).tolist()
        # the model's fp32 mean over a micro-batch's 128 tokens against sums in doubles: 129u = 7.7e-6
        assert per[dom]["loss"] == pytest.approx(num / den, rel=1e-5)
        assert per[dom]["tokens"] == den
        # bytes: the label windows are contiguous in the stream, so decoding them all at once
        # gives the text (special tokens skipped) and its UTF-8 bytes
        text = eval_data.tokenizer.decode(labels_stream, skip_special_tokens=True)
        nbytes = len(text.encode("utf-8"))
        assert per[dom]["bytes"] == nbytes
        assert per[dom]["bits_per_byte"] == pytest.approx(num / (nbytes * math.log(2)), rel=1e-5)
        want = (pos_n / pos_t).tolist()
        assert per[dom]["per_position"] == pytest.approx(want, rel=1e-5)
        for bucket in per[dom]["positions"]:
            s, e = bucket["start"], bucket["end"]
            assert bucket["loss"] == pytest.approx(float(pos_n[s - 1:e].sum() / pos_t[s - 1:e].sum()), rel=1e-5)
        tot["nats"] += num
        tot["tok"] += den
        tot["bytes"] += nbytes
        dom_loss.append(num / den)
        dom_bpb.append(num / (nbytes * math.log(2)))
    # `all`: the domains weighted equally (as training's val/all); its counts are sums
    assert per["all"]["loss"] == pytest.approx(sum(dom_loss) / len(dom_loss), rel=1e-5)
    assert per["all"]["bits_per_byte"] == pytest.approx(sum(dom_bpb) / len(dom_bpb), rel=1e-5)
    assert (per["all"]["tokens"], per["all"]["bytes"]) == (tot["tok"], tot["bytes"])


def test_seq_len_beyond_context_is_a_config_error(random_exports):
    from smelt_ds.eval.suite import EvalSettings, evaluate_runs

    run = _loaded(random_exports["smelt"])
    with pytest.raises(ConfigError, match=r"`--seq-len` \(65\) exceeds `model.max_seq_len` \(64\)"):
        evaluate_runs([run], EvalSettings(seq_len=65, tasks=()), log=lambda *_: None)
