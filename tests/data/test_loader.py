"""Training and validation loaders: window contents, rank sharding, resume, weights, compatibility."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from smelt_ds.data.loader import TrainLoader, ValidationLoader, check_compatible, validation_loaders
from smelt_ds.data.prepare import PreparedData
from smelt_ds.errors import ConfigError

S, B = 32, 4


def window_table(prepared: PreparedData, split: str, seq_len: int, domain: str | None = None):
    """(shard, start token) of every window, computed here from the shard sizes: (N - 1) // S per shard."""
    if split == "train":
        shards = [sh for s in prepared.meta["sources"] for sh in prepared.shards("train", source=s["index"])]
    else:
        shards = prepared.shards(split, domain=domain)
    return [(sh, j * seq_len) for sh in shards for j in range(max(0, (sh["tokens"] - 1) // seq_len))], shards


def expected_window(prepared, table, sample_id, seq_len):
    shard, start = table[sample_id]
    return np.asarray(prepared.tokens(shard)[start:start + seq_len + 1], dtype=np.int64)


def take_ids(loader, n):
    return [next(loader)["sample_ids"].tolist() for _ in range(n)]


# --------------------------------------------------------------------------------------------
# contents
# --------------------------------------------------------------------------------------------


def test_batches_are_shifted_windows_of_the_shards(two_domains):
    loader = TrainLoader(two_domains, S, B, seed=3, dp_rank=0, dp_world_size=1)
    table, _ = window_table(two_domains, "train", S)
    assert loader.num_windows == len(table)
    for _ in range(5):
        batch = next(loader)
        assert batch["input_ids"].shape == (B, S) and batch["labels"].shape == (B, S)
        assert batch["input_ids"].dtype == torch.int64 and batch["labels"].dtype == torch.int64
        for row, sid in enumerate(batch["sample_ids"].tolist()):
            window = expected_window(two_domains, table, sid, S)
            assert batch["input_ids"][row].tolist() == window[:-1].tolist()
            assert batch["labels"][row].tolist() == window[1:].tolist()


def test_windows_cover_every_token_but_the_declared_remainder(two_domains):
    loader = TrainLoader(two_domains, S, B, dp_rank=0, dp_world_size=1)
    table, shards = window_table(two_domains, "train", S)
    remainder = 0
    for shard in shards:
        tokens = np.asarray(two_domains.tokens(shard))
        starts = [start for sh, start in table if sh is shard]
        rebuilt = [int(tokens[0])] + [int(t) for st in starts for t in tokens[st + 1:st + S + 1]]
        assert rebuilt == tokens[:len(rebuilt)].tolist()
        remainder += tokens.size - len(rebuilt)
    assert loader.remainder_tokens == remainder
    assert sum(sh["tokens"] for sh in shards) == loader.num_windows * S + len(shards) + remainder


# --------------------------------------------------------------------------------------------
# sharding and order
# --------------------------------------------------------------------------------------------


def test_ranks_read_disjoint_samples_and_cover_the_epoch(two_domains):
    loaders = [TrainLoader(two_domains, S, B, seed=5, dp_rank=r, dp_world_size=2) for r in range(2)]
    steps = loaders[0].steps_per_epoch
    seen = [sum(take_ids(ld, steps), []) for ld in loaders]
    assert not set(seen[0]) & set(seen[1])
    both = seen[0] + seen[1]
    assert len(both) == len(set(both)) == steps * 2 * B
    assert loaders[0].num_windows - len(both) == loaders[0].num_windows % (2 * B)  # only the tail is dropped
    assert set(both) <= set(range(loaders[0].num_windows))


def test_epochs_are_reshuffled_permutations(two_domains):
    loader = TrainLoader(two_domains, S, B, seed=5, dp_rank=0, dp_world_size=1)
    e0, e1 = loader.epoch_order(0).copy(), loader.epoch_order(1).copy()
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == list(range(loader.num_windows))
    assert e0.tolist() != e1.tolist()
    other_seed = TrainLoader(two_domains, S, B, seed=6, dp_rank=0, dp_world_size=1)
    assert other_seed.epoch_order(0).tolist() != e0.tolist()


@pytest.mark.parametrize("rank", [0, 1])
def test_resume_sees_the_uninterrupted_sequence(two_domains, rank):
    def make():
        return TrainLoader(two_domains, S, B, seed=11, dp_rank=rank, dp_world_size=2)

    steps = make().steps_per_epoch
    total, cut = steps + 7, steps - 3  # the resumed part crosses an epoch boundary
    straight = take_ids(make(), total)
    first = make()
    before = take_ids(first, cut)
    state = copy.deepcopy(first.state_dict())
    resumed = make()
    resumed.load_state_dict(state)
    after = take_ids(resumed, total - cut)
    assert before + after == straight
    assert resumed.epoch == 1


def _steps_of(loaders, accum, steps):
    """Micro-batches of ``steps`` optimizer steps read by ``loaders`` (one per data-parallel rank),
    each step as the set of its micro-batches (tuples of sample ids): which rank or accumulation
    slot reads a micro-batch does not change the step's summed gradient."""
    out = []
    for _ in range(steps):
        out.append(sorted(tuple(next(ld)["sample_ids"].tolist()) for _ in range(accum) for ld in loaders))
    return out


@pytest.mark.parametrize("before,after", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_resume_at_another_data_parallel_size_reads_the_same_micro_batches_in_the_same_steps(two_domains, before,
                                                                                              after):
    """A global batch of 40 samples (B=5): 8 micro-batches per step on 1 rank, 2 x 4 on 2, 4 x 2
    on 4. Resumed at another data-parallel size after 3 steps, then across two epoch boundaries,
    every optimizer step holds the same micro-batches (the same samples grouped the same way) as
    the uninterrupted run. Fails when the epoch is cut to the global micro-batch (the v1 rule:
    ``epoch_unit=None``), where epochs of the two layouts end at different samples."""
    G, B5, steps = 40, 5, 3
    per_epoch = TrainLoader(two_domains, S, B5, seed=2, dp_rank=0, dp_world_size=1).windows_per_epoch
    total = 2 * per_epoch // G + 3  # past the second epoch boundary

    def run(world):
        return [TrainLoader(two_domains, S, B5, seed=2, dp_rank=r, dp_world_size=world, epoch_unit=G)
                for r in range(world)]

    ref = run(before)
    want = _steps_of(ref, G // (B5 * before), total)
    first = run(before)
    got = _steps_of(first, G // (B5 * before), steps)
    state = first[0].state_dict()
    assert state["epoch_unit"] == G
    second = run(after)
    for ld in second:
        ld.load_state_dict(state)
    got += _steps_of(second, G // (B5 * after), total - steps)
    assert got == want
    assert per_epoch % G and per_epoch % (B5 * before) != per_epoch % G  # the cut matters for this data


def test_a_data_parallel_size_that_cannot_form_the_global_batch_is_refused_naming_the_sizes(two_domains):
    state = TrainLoader(two_domains, S, B, seed=2, dp_rank=0, dp_world_size=1, epoch_unit=8).state_dict()
    three = TrainLoader(two_domains, S, B, seed=2, dp_rank=0, dp_world_size=4)
    with pytest.raises(ConfigError, match="cuts its epochs to multiples of 8 samples.*divides 2"):
        three.load_state_dict(state)


def test_a_version_1_state_keeps_its_own_epoch_cut(two_domains):
    """A checkpoint written before the epoch cut was recorded (loader state version 1) resumes at its
    own layout, with the cut it had (the global micro-batch), even when the new run's is a step."""
    one = TrainLoader(two_domains, S, B, seed=2, dp_rank=0, dp_world_size=1)
    take_ids(one, 5)
    state = {k: v for k, v in one.state_dict().items() if k != "epoch_unit"}
    state["version"] = 1
    again = TrainLoader(two_domains, S, B, seed=2, dp_rank=0, dp_world_size=1, epoch_unit=8)
    again.load_state_dict(state)
    assert again.epoch_unit == B
    n = one.steps_per_epoch + 2
    assert take_ids(again, n) == take_ids(one, n)


def test_resume_refuses_other_seed_or_data(two_domains, builtin_prepared):
    state = TrainLoader(two_domains, S, B, seed=1, dp_rank=0, dp_world_size=1).state_dict()
    with pytest.raises(ConfigError, match=r"seed 1 \(checkpoint\) != 2"):
        TrainLoader(two_domains, S, B, seed=2, dp_rank=0, dp_world_size=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="prepared_key|num_windows"):
        TrainLoader(builtin_prepared, S, B, seed=1, dp_rank=0, dp_world_size=1).load_state_dict(state)
    state["consumed_samples"], state["epoch_unit"] = 4, 8
    with pytest.raises(ConfigError, match="not a multiple of the global micro-batch 8"):
        TrainLoader(two_domains, S, B, seed=1, dp_rank=0, dp_world_size=2, epoch_unit=8).load_state_dict(state)


def test_train_digest_changes_with_the_train_split_only(two_domains):
    """What a resume checks (loader state ``train_digest``): a train shard's sha256 or a user token
    file's sampled sha256 changes it; a validation shard, the creation record or the library
    versions do not (a rebuild of the same data resumes)."""

    def digest(edit) -> str:
        meta = copy.deepcopy(two_domains.meta)
        edit(meta)
        return PreparedData(two_domains.root, meta).train_digest

    base = two_domains.train_digest
    train = next(i for i, sh in enumerate(two_domains.meta["shards"]) if sh["split"] == "train")
    val = next(i for i, sh in enumerate(two_domains.meta["shards"]) if sh["split"] == "validation")
    assert digest(lambda m: m["shards"][train].update(sha256="0" * 64)) != base
    assert digest(lambda m: m.update(token_files=[{"path": "/d/m.bin", "sample_sha256": "a"}])) != \
        digest(lambda m: m.update(token_files=[{"path": "/d/m.bin", "sample_sha256": "b"}]))
    assert digest(lambda m: m["shards"][val].update(sha256="0" * 64)) == base
    assert digest(lambda m: m.update(created={"time": "later"}, versions={})) == base
    state = TrainLoader(two_domains, S, B, seed=1, dp_rank=0, dp_world_size=1).state_dict()
    meta = copy.deepcopy(two_domains.meta)
    meta["shards"][train]["sha256"] = "0" * 64
    with pytest.raises(ConfigError, match="changed since the checkpoint"):
        TrainLoader(PreparedData(two_domains.root, meta), S, B, seed=1, dp_rank=0,
                    dp_world_size=1).load_state_dict(state)
    del state["train_digest"]  # a checkpoint from before the digest was recorded: resumes as before
    TrainLoader(PreparedData(two_domains.root, meta), S, B, seed=1, dp_rank=0, dp_world_size=1).load_state_dict(state)


def test_mixture_weights_set_windows_per_epoch(two_domains):
    meta = copy.deepcopy(two_domains.meta)
    meta["sources"][1]["weight"] = 2.0   # shakespeare twice
    meta["sources"][0]["weight"] = 0.5   # half of wiki
    weighted = PreparedData(two_domains.root, meta)
    loader = TrainLoader(weighted, S, B, seed=4, dp_rank=0, dp_world_size=1)
    plain = TrainLoader(two_domains, S, B, seed=4, dp_rank=0, dp_world_size=1)
    n_wiki = sum((sh["tokens"] - 1) // S for sh in two_domains.shards("train", source=0))
    n_shak = plain.num_windows - n_wiki
    order = loader.epoch_order(0)
    assert int((order < n_wiki).sum()) == round(0.5 * n_wiki)
    shak = order[order >= n_wiki]
    assert shak.size == 2 * n_shak and np.bincount(shak - n_wiki).tolist() == [2] * n_shak
    wiki_1 = set(loader.epoch_order(1)[loader.epoch_order(1) < n_wiki].tolist())
    assert wiki_1 != set(order[order < n_wiki].tolist())  # another half next epoch


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def test_validation_loader_per_domain(two_domains):
    loaders = validation_loaders(two_domains, S, B, dp_rank=0, dp_world_size=1)
    assert sorted(loaders) == ["shakespeare", "wiki"]
    for domain, loader in loaders.items():
        table, _ = window_table(two_domains, "validation", S, domain)
        ids = []
        for batch in loader:
            for row, sid in enumerate(batch["sample_ids"].tolist()):
                assert batch["input_ids"][row].tolist() == expected_window(two_domains, table, sid, S)[:-1].tolist()
            ids += batch["sample_ids"].tolist()
        assert ids == list(range(len(table)))
        assert list(loader) and len(list(loader)) == len(loader)  # iterating again starts over


def test_validation_ranks_split_windows_evenly(two_domains):
    table, _ = window_table(two_domains, "validation", S, "wiki")
    per_rank = [sum((b["sample_ids"].tolist() for b in ValidationLoader(two_domains, "wiki", S, B, dp_rank=r,
                                                                        dp_world_size=2)), []) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == len(table) // 2
    assert not set(per_rank[0]) & set(per_rank[1])


# --------------------------------------------------------------------------------------------
# compatibility with the model
# --------------------------------------------------------------------------------------------


def test_check_compatible_names_both_values(two_domains):
    check_compatible(two_domains, 400, two_domains.tokenizer_hash)
    check_compatible(two_domains, 512)  # a padded model vocabulary (rows no token id reaches)
    with pytest.raises(ConfigError, match=r"`model.vocab_size` \(399\) is smaller.*400 tokens"):
        check_compatible(two_domains, 399)
    with pytest.raises(ConfigError, match=r"tokenizer hash 000000000000 .* " + two_domains.tokenizer_hash[:12]):
        check_compatible(two_domains, 400, "0" * 64)
    with pytest.raises(ConfigError, match=r"`model.vocab_size` \(256\)"):
        TrainLoader(two_domains, S, B, dp_rank=0, dp_world_size=1, model_vocab_size=256)


def test_bad_loader_sizes(two_domains):
    with pytest.raises(ConfigError, match=r"`train.seq_len` \(0\) must be > 0"):
        TrainLoader(two_domains, 0, B, dp_rank=0, dp_world_size=1)
    with pytest.raises(ConfigError, match=r"dp_rank \(2\) must be in \[0, 2\)"):
        TrainLoader(two_domains, S, B, dp_rank=2, dp_world_size=2)
