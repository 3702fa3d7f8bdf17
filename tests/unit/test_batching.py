import tracemalloc

import numpy as np
import pytest
import torch

from dflash_actors.data.batching import Batch, BatchBuffers, assemble, plan_epoch
from dflash_actors.data.dataset import TokenDataset
from dflash_actors.data.synthetic import flatten, write_token_dataset

BUDGET, MAX_SAMPLES = 512, 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(4, 0.8, 700).astype(int), 1, BUDGET)
    ids = [rng.integers(0, 1000, n) for n in lengths]
    masks = [rng.integers(0, 2, n).astype(np.int8) for n in lengths]
    d = tmp_path_factory.mktemp("ds") / "ds"
    offsets, flat = flatten(ids)
    write_token_dataset(d, offsets, flat, flatten(masks)[1], num_shards=2, rows_per_batch=97)
    return TokenDataset(d), ids, masks


def plan(ds, epoch, seed=3):
    return plan_epoch(ds.lengths, BUDGET, MAX_SAMPLES, 8, seed, epoch)


def test_plan_is_pure_and_epoch_dependent(dataset):
    # Purity is what resuming from a batch id (or sharding) relies on: re-plan, index.
    ds = dataset[0]
    a, b = plan(ds, 0), plan(ds, 0)
    np.testing.assert_array_equal(a.sample_ids, b.sample_ids)
    np.testing.assert_array_equal(a.offsets, b.offsets)
    assert not np.array_equal(a.sample_ids, plan(ds, 1).sample_ids)
    assert not np.array_equal(a.sample_ids, plan(ds, 0, seed=4).sample_ids)


def test_plan_covers_epoch_once_within_budget(dataset):
    ds = dataset[0]
    p = plan(ds, 2)
    assert sorted(p.sample_ids.tolist()) == list(range(len(ds)))
    for b in range(len(p)):
        lens = ds.lengths[p.batch(b)]
        assert 1 <= len(lens) <= MAX_SAMPLES
        assert len(lens) * lens.max() <= BUDGET
        assert p.max_lens[b] == lens.max()
    s = p.stats(ds.lengths, BUDGET)
    assert s["batches"] == len(p) and s["samples"] == len(ds)
    assert s["padding_efficiency"] > 0.8


def test_plan_rejects_oversized_sample(dataset):
    with pytest.raises(ValueError, match="exceeds token_budget"):
        plan_epoch(np.array([10, 600]), BUDGET, MAX_SAMPLES, 8, 0, 0)


def test_assembled_batches_equal_source_tokens(dataset):
    ds, ids, masks = dataset
    p = plan(ds, 0)
    buf = BatchBuffers.allocate(BUDGET, MAX_SAMPLES)
    buf.input_ids[:] = -1   # stale contents must not matter
    for b in range(len(p)):
        members = p.batch(b)
        meta = assemble(ds, members, buf)
        batch = Batch.from_buffers(buf, meta)
        assert meta.n_samples == len(members) and meta.max_len == ds.lengths[members].max()
        for r, (s, e) in enumerate(batch.sequences()):
            i = int(members[r])
            np.testing.assert_array_equal(batch.input_ids[s:e].numpy(), ids[i])
            np.testing.assert_array_equal(batch.loss_mask[s:e].numpy(), masks[i])
            np.testing.assert_array_equal(batch.position_ids[s:e].numpy(), np.arange(len(ids[i])))
        np.testing.assert_array_equal(buf.sample_ids[:meta.n_samples], members)
        assert meta.n_tokens == ds.lengths[members].sum()


def test_padded_view_round_trips(dataset):
    ds, ids, _ = dataset
    p = plan(ds, 1)
    buf = BatchBuffers.allocate(BUDGET, MAX_SAMPLES)
    batch = Batch.from_buffers(buf, assemble(ds, p.batch(0), buf))
    padded = batch.padded(pad_id=-7)
    assert padded.shape == (batch.n_samples, batch.max_len)
    row, col = batch.pad_index()
    assert torch.equal(padded[row, col], batch.input_ids)
    for r, i in enumerate(p.batch(0)):
        n = len(ids[i])
        assert torch.equal(padded[r, :n], torch.from_numpy(ids[i]))
        assert (padded[r, n:] == -7).all()


def test_assembly_allocates_nothing_proportional_to_tokens(tmp_path):
    budget = 16384   # one batch of int64 tokens = 128 KiB; steady state must stay far below
    rng = np.random.default_rng(2)
    lengths = rng.integers(budget // 64, budget // 8, 300)
    offsets, flat = flatten([rng.integers(0, 1000, n) for n in lengths])
    write_token_dataset(tmp_path / "big", offsets, flat, (flat % 2).astype(np.int8))
    ds = TokenDataset(tmp_path / "big")
    p = plan_epoch(ds.lengths, budget, MAX_SAMPLES, 8, 0, 0)
    buf = BatchBuffers.allocate(budget, MAX_SAMPLES)
    assemble(ds, p.batch(0), buf)   # warm up
    tracemalloc.start()
    for b in range(len(p)):
        assemble(ds, p.batch(b), buf)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 * 1024, peak


def test_assembly_rejects_overflow(dataset):
    ds = dataset[0]
    small = BatchBuffers.allocate(8, 2)
    with pytest.raises(ValueError, match="max_samples"):
        assemble(ds, np.arange(3), small)
    longest = int(np.argmax(ds.lengths))
    with pytest.raises(ValueError, match="exceeds the slot"):
        assemble(ds, np.array([longest]), small)
