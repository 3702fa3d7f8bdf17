"""The feature cache on a hand-made schedule: first(s), the cacheable set, the present
flag as the commit point, and the disk header that guards a reused cache."""

import pickle

import numpy as np
import pytest
import torch

from dflash_actors.config import ConfigError, config_from_dict
from dflash_actors.data.batching import Batch, BatchBuffers, EpochPlan, assemble
from dflash_actors.train import feature_cache as fc
from dflash_actors.train.schedule import Schedule

LENGTHS = np.array([2, 3, 1, 4, 2, 5], np.int32)
# Three epochs of three batches each; two batches per step, so each epoch's third batch
# is dropped (sample 4 in epoch 0: its first batch is in epoch 1).
EPOCHS = [[[0, 1], [2, 3], [4]], [[4, 0], [5, 1], [2, 3]], [[5, 2], [3, 4], [1, 0]]]
SCHEDULE = Schedule(per_step=2, num_drafters=1, steps_per_epoch=(1, 1, 1))
WIDTH = 2                                       # float32: 8 bytes a token


def _plan(batches, epoch=0):
    ids = np.concatenate([np.array(b, np.int64) for b in batches])
    return EpochPlan(epoch, ids, np.concatenate([[0], np.cumsum([len(b) for b in batches])]).astype(np.int64),
                     np.array([LENGTHS[b].max() for b in batches], np.int32))


PLANS = [_plan(b, e) for e, b in enumerate(EPOCHS)]


def _cache_plan(budget_tokens, plans=PLANS):
    return fc.plan_cache(plans, SCHEDULE, LENGTHS, WIDTH, "float32", budget_tokens * WIDTH * 4)


def test_first_batch_and_cacheable_set_by_hand():
    p = _cache_plan(10)
    # run batches: 0=[0,1] 1=[2,3] | 2=[4,0] 3=[5,1] | 4=[5,2] 5=[3,4]
    assert p.first.tolist() == [0, 0, 1, 1, 2, 3]
    # In first-batch order: 0 (2 tokens), 1 (3), 2 (1), 3 (4) fill 10 tokens exactly; 4 would make 12.
    assert p.slot.tolist() == [0, 1, 2, 3, -1, -1]
    assert p.offsets.tolist() == [0, 2, 5, 6, 10] and p.nbytes == 10 * WIDTH * 4
    assert _cache_plan(11.9).slot.tolist() == [0, 1, 2, 3, -1, -1]
    assert _cache_plan(12).slot.tolist() == [0, 1, 2, 3, 4, -1]
    assert _cache_plan(1).slots == 0


def test_plan_digest_follows_the_batches_that_make_the_bits():
    base = _cache_plan(10).digest
    # Epoch 2 holds no cached sample's first batch: replanning it changes no bits.
    assert _cache_plan(10, PLANS[:2] + [_plan([[0, 1], [2, 3], [4, 5]], 2)]).digest == base
    # Batch 0 packed with another partner: the same samples are cached, computed otherwise.
    other = [_plan([[0, 4], [2, 3], [1]], 0)] + PLANS[1:]
    assert _cache_plan(10, other).digest != base


class Tokens:
    """A dataset whose sample s is the tokens s*10, s*10+1, ..."""

    lengths = LENGTHS

    def gather(self, ids, ids_out, mask_out):
        pos = 0
        for s in ids:
            n = int(LENGTHS[s])
            ids_out[pos:pos + n] = s * 10 + np.arange(n)
            mask_out[pos:pos + n] = 1
            pos += n


class Source:
    """``BatchSource`` over the hand-made plans; records the batches it assembles."""

    def __init__(self):
        self.assembled = []

    def batch(self, g):
        self.assembled.append(g)
        return _assemble(g)


def _assemble(g):
    epoch, i = SCHEDULE.locate(g)
    ids = PLANS[epoch].batch(i)
    buf = BatchBuffers.allocate(64, 8)
    meta = assemble(Tokens(), ids, buf)
    return ids, buf.cu_seqlens[:meta.n_samples + 1].copy(), Batch.from_buffers(buf, meta)


class Forward:
    """Features that depend on the batch a token is packed in (its total length), as a
    real target's do at float rounding; counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, batch):
        self.calls += 1
        t = batch.input_ids.float()[:, None].expand(-1, WIDTH)
        return (t + 1000 * float(batch.cu_seqlens[-1])).clone()


def _cache(budget_tokens=10):
    plan = _cache_plan(budget_tokens)
    return fc.FeatureCache("memory", plan, fc.MemoryStore.allocate(plan, shared=False), Source(),
                           torch.zeros(1, len(fc.COUNTERS), dtype=torch.int64))


def _features(cache, g, fwd):
    ids, cu, batch = _assemble(g)
    return ids, cu, cache.features(g, ids, cu, batch, fwd, torch.device("cpu"))


def _rows(g, fwd, sample):
    """Sample's rows in the plain forward of run batch g."""
    ids, cu, batch = _assemble(g)
    r = list(ids).index(sample)
    return fwd(batch)[cu[r]:cu[r + 1]]


def test_later_batches_get_the_first_batch_rows_and_skip_the_forward():
    cache, fwd = _cache(), Forward()
    for g in (0, 1):                        # samples 0..3 computed and stored
        _features(cache, g, fwd)
    assert fwd.calls == 2 and cache.store.present.tolist() == [1, 1, 1, 1]
    ids, cu, out = _features(cache, 2, fwd)         # [4, 0]: 4 not cached, so the forward runs
    assert fwd.calls == 3
    assert torch.equal(out[cu[1]:cu[2]], _rows(0, Forward(), 0))         # sample 0 as batch 0 made it
    assert torch.equal(out[cu[0]:cu[1]], _rows(2, Forward(), 4))         # sample 4 as this batch makes it
    assert not torch.equal(_rows(2, Forward(), 0), _rows(0, Forward(), 0))  # what the cache changes
    st = cache.stats()
    assert st["forwards_skipped"] == 0 and st["samples_served"] == 1 and st["samples_repeated"] == 1
    cache2, fwd2 = _cache(12), Forward()            # sample 4 cached too: batch 4 = [5, 2] still runs, 5 = [3, 4] not
    for g in range(4):
        _features(cache2, g, fwd2)
    calls = fwd2.calls
    _, cu, out = _features(cache2, 5, fwd2)
    assert fwd2.calls == calls and cache2.stats()["forwards_skipped"] == 1
    assert torch.equal(out[cu[1]:cu[2]], _rows(2, Forward(), 4))


def test_present_flag_decides_what_is_served():
    cache, fwd = _cache(), Forward()
    _features(cache, 0, fwd)
    _features(cache, 1, fwd)
    # A writer killed between rows and flag: slot 2 (sample 2) has rows but no flag.
    cache.store.rows[5:6] = -1.0
    cache.store.present[2] = 0
    # Sample 1's flag is set over planted rows: the flag is the commit point, so they are served.
    cache.store.rows[2:5] = -7.0
    _, cu, out = _features(cache, 4, fwd)            # [5, 2]: sample 2 wanted, absent
    assert cache.source.assembled == [1]             # its first batch, assembled again
    assert torch.equal(out[cu[1]:cu[2]], _rows(1, Forward(), 2)) and cache.store.present[2] == 1
    st = cache.stats()
    assert st["misses"] == 1 and st["first_batches_recomputed"] == 1 and st["samples_served"] == 0
    _, cu, out = _features(cache, 3, fwd)            # [5, 1]
    assert (out[cu[1]:cu[2]] == -7.0).all()
    assert cache.source.assembled == [1]


def test_midway_runs_between_rows_and_flags():
    cache, seen = _cache(), []
    ids, cu, batch = _assemble(0)
    cache.features(0, ids, cu, batch, Forward(), torch.device("cpu"),
                   midway=lambda: seen.append((cache.store.present.copy(), cache.store.rows[:5].clone())))
    flags, rows = seen[0]
    assert flags.tolist() == [0, 0, 0, 0] and (rows != 0).all()
    assert cache.store.present.tolist() == [1, 1, 0, 0]


def _header(**change):
    return {"format": fc.FORMAT, "data": {"path": "/d", "files": "abc"}, "target": {"path": "/t"},
            "layer_ids": [1], "dtype": "float32", "width": WIDTH, **change}


def test_disk_store_is_kept_when_it_matches_and_discarded_when_foreign(tmp_path):
    plan, root = _cache_plan(10), tmp_path / fc.CACHE_DIR
    store, line = fc.DiskStore.open(root, plan, _header())
    assert line is None and store.present.tolist() == [0, 0, 0, 0]
    store.rows[:2] = 3.0
    store.present[0] = 1
    again = pickle.loads(pickle.dumps(store))       # as a target maps it
    assert again.present[0] == 1 and (again.rows[:2] == 3.0).all()
    again.present[1] = 1
    kept, line = fc.DiskStore.open(root, plan, _header())
    assert line is None and kept.present.tolist() == [1, 1, 0, 0] and (kept.rows[:2] == 3.0).all()
    fresh, line = fc.DiskStore.open(root, plan, _header(data={"path": "/other", "files": "abc"}))
    assert line is not None and "its data differ" in line and "discarded" in line
    assert fresh.present.tolist() == [0, 0, 0, 0] and (fresh.rows == 0).all()
    (root / fc.DiskStore.FLAGS).write_bytes(b"\1")       # the header matches, the files do not
    _, line = fc.DiskStore.open(root, plan, _header(data={"path": "/other", "files": "abc"}))
    assert "wrong size" in line
    (root / fc.HEADER).unlink()
    rebuilt, line = fc.DiskStore.open(root, plan, _header())
    assert "no header" in line and rebuilt.present.tolist() == [0, 0, 0, 0]


def test_the_cache_is_refused_under_simulated_compute():
    cfg = config_from_dict({"target": {"feature_cache": "memory"}, "runtime": {"simulate": {"enabled": True}}})
    with pytest.raises(ConfigError, match="target.feature_cache: memory under runtime.simulate"):
        fc.check(cfg)
    fc.check(config_from_dict({"runtime": {"simulate": {"enabled": True}}}))
