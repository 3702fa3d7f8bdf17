import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_actors.data.dataset import DatasetError, TokenDataset
from dflash_actors.data.synthetic import flatten, write_token_dataset

RNG = np.random.default_rng(0)
SAMPLES = [RNG.integers(0, 100, n) for n in (5, 1, 9, 3, 12, 7)]
MASKS = [(RNG.random(len(s)) > 0.3).astype(np.int8) for s in SAMPLES]


def table(ids=SAMPLES, masks=MASKS, id_type=pa.int32(), mask_type=pa.int8(), seq_len=None, large=False):
    lt = pa.large_list if large else pa.list_
    cols = {"input_ids": pa.array([list(map(int, s)) for s in ids], lt(id_type))}
    if masks is not None:
        cols["loss_mask"] = pa.array([[bool(x) if mask_type == pa.bool_() else int(x) for x in m] for m in masks],
                                     lt(mask_type))
    if seq_len is not None:
        cols["seq_len"] = pa.array(seq_len, pa.int64())
    return pa.table(cols)


def write_stream(path, t, chunk=None):
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
        for b in t.to_batches(max_chunksize=chunk):
            w.write_batch(b)
    return path


def assert_samples(ds, ids=SAMPLES, masks=MASKS):
    assert len(ds) == len(ids)
    for i, (s, m) in enumerate(zip(ids, masks if masks is not None else [None] * len(ids))):
        got_ids, got_mask = ds.sample(i)
        np.testing.assert_array_equal(got_ids, s)
        np.testing.assert_array_equal(got_mask, m if m is not None else np.ones(len(s), np.int8))


@pytest.mark.parametrize("chunk", [None, 2, 4])
def test_arrow_stream_chunks(tmp_path, chunk):
    ds = TokenDataset(write_stream(tmp_path / "d.arrow", table(), chunk))
    assert_samples(ds)
    np.testing.assert_array_equal(ds.lengths, [len(s) for s in SAMPLES])


def test_arrow_file_format_large_list_int64_bool_mask(tmp_path):
    t = table(id_type=pa.int64(), mask_type=pa.bool_(), large=True)
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as f, pa.ipc.new_file(f, t.schema) as w:
        w.write_table(t, max_chunksize=4)
    assert_samples(TokenDataset(tmp_path / "f.arrow"))


def test_parquet_and_missing_loss_mask(tmp_path):
    pq.write_table(table(masks=None), tmp_path / "d.parquet", row_group_size=2)
    assert_samples(TokenDataset(tmp_path / "d.parquet"), masks=None)


def test_own_writer_multi_shard_dir(tmp_path):
    offsets, ids = flatten(SAMPLES)
    write_token_dataset(tmp_path / "ds", offsets, ids, flatten(MASKS)[1], num_shards=3, rows_per_batch=1)
    assert len(json.loads((tmp_path / "ds/state.json").read_text())["_data_files"]) == 3
    assert_samples(TokenDataset(tmp_path / "ds"))


def test_real_datasets_save_to_disk_several_shards(tmp_path):
    datasets = pytest.importorskip("datasets")
    d = datasets.Dataset.from_dict({"input_ids": [s.tolist() for s in SAMPLES],
                                    "loss_mask": [m.tolist() for m in MASKS],
                                    "seq_len": [len(s) for s in SAMPLES]})
    d.save_to_disk(str(tmp_path / "hf"), num_shards=3)
    assert len(list((tmp_path / "hf").glob("data-*.arrow"))) == 3
    assert_samples(TokenDataset(tmp_path / "hf"))
    # A filtered/sliced HF dataset keeps the parent's child buffers (slice offsets matter).
    sub = d.select(range(2, 6)).flatten_indices()
    sub.save_to_disk(str(tmp_path / "hf_sub"))
    assert_samples(TokenDataset(tmp_path / "hf_sub"), SAMPLES[2:6], MASKS[2:6])


def test_sliced_record_batches_use_absolute_offsets(tmp_path):
    t = table()
    batch = t.to_batches()[0].slice(2, 3)      # child buffers still hold rows 0..5
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as f, pa.ipc.new_stream(f, batch.schema) as w:
        w.write_batch(batch)
    assert_samples(TokenDataset(tmp_path / "s.arrow"), SAMPLES[2:5], MASKS[2:5])


# --- validation: each error names the file and the first bad row ------------------------

def test_missing_input_ids(tmp_path):
    p = write_stream(tmp_path / "x.arrow", pa.table({"tokens": pa.array([[1, 2]])}))
    with pytest.raises(DatasetError, match=r"x\.arrow: missing column 'input_ids'"):
        TokenDataset(p)


def test_length_mismatch(tmp_path):
    masks = [m.copy() for m in MASKS]
    masks[3] = masks[3][:-1]
    p = write_stream(tmp_path / "x.arrow", table(masks=masks), chunk=2)
    with pytest.raises(DatasetError, match=r"x\.arrow: row 3: input_ids has 3 tokens but loss_mask has 2"):
        TokenDataset(p)


def test_empty_sample(tmp_path):
    ids = list(SAMPLES)
    ids[4] = np.zeros(0, np.int64)
    p = write_stream(tmp_path / "x.arrow", table(ids=ids, masks=None), chunk=4)
    with pytest.raises(DatasetError, match=r"row 4: empty sample"):
        TokenDataset(p)


def test_null_sample(tmp_path):
    arr = pa.array([[1, 2], None, [3]], pa.list_(pa.int32()))
    p = write_stream(tmp_path / "x.arrow", pa.table({"input_ids": arr}))
    with pytest.raises(DatasetError, match=r"row 1: input_ids is null"):
        TokenDataset(p)


def test_seq_len_disagrees(tmp_path):
    seq = [len(s) for s in SAMPLES]
    seq[5] += 1
    p = write_stream(tmp_path / "x.arrow", table(seq_len=seq))
    with pytest.raises(DatasetError, match=r"row 5: seq_len says 8 but input_ids has 7"):
        TokenDataset(p)


def test_token_out_of_vocab_and_bad_mask(tmp_path):
    ids = [s.copy() for s in SAMPLES]
    ids[2][4] = 100
    ds = TokenDataset(write_stream(tmp_path / "x.arrow", table(ids=ids), chunk=2))
    ds.check_values(101)
    with pytest.raises(DatasetError, match=r"x\.arrow: row 2: input_ids value 100 outside \[0, 100\)"):
        ds.check_values(100)
    masks = [m.copy() for m in MASKS]
    masks[4][0] = 3
    ds = TokenDataset(write_stream(tmp_path / "y.arrow", table(masks=masks)))
    with pytest.raises(DatasetError, match=r"row 4: loss_mask value 3 not 0 or 1"):
        ds.check_values(100)


def test_row_numbers_are_per_file(tmp_path):
    offsets, flat = flatten(SAMPLES)
    masks = [m.copy() for m in MASKS]
    masks[5][-1] = 7
    write_token_dataset(tmp_path / "ds", offsets, flat, flatten(masks)[1], num_shards=2)
    with pytest.raises(DatasetError, match=r"data-00001-of-00002\.arrow: row 2: loss_mask"):
        TokenDataset(tmp_path / "ds").check_values(100)


def test_wrong_types_and_paths(tmp_path):
    p = write_stream(tmp_path / "f.arrow", pa.table({"input_ids": pa.array([[0.5]])}))
    with pytest.raises(DatasetError, match="must hold integers"):
        TokenDataset(p)
    with pytest.raises(DatasetError, match="dataset not found"):
        TokenDataset(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no .arrow or .parquet shards"):
        TokenDataset(tmp_path / "empty")
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(DatasetError, match="not an Arrow IPC"):
        TokenDataset(tmp_path / "junk.arrow")


def test_overlong_truncate_and_drop(tmp_path):
    p = write_stream(tmp_path / "x.arrow", table())
    t = TokenDataset(p, max_seq_len=6, overlong="truncate")
    assert t.n_truncated == 3 and len(t) == 6
    np.testing.assert_array_equal(t.sample(2)[0], SAMPLES[2][:6])
    d = TokenDataset(p, max_seq_len=6, overlong="drop")
    assert d.n_dropped == 3 and len(d) == 3
    kept = [0, 1, 3]
    assert_samples(d, [SAMPLES[i] for i in kept], [MASKS[i] for i in kept])
    with pytest.raises(DatasetError, match="every sample is longer"):
        TokenDataset(p, max_seq_len=0, overlong="drop")


def test_stream_cut_at_a_batch_boundary_is_named(tmp_path):
    """pyarrow reads such a stream without error, minus its tail; the missing
    end-of-stream marker gives it away."""
    whole = write_stream(tmp_path / "whole.arrow", table(), chunk=2).read_bytes()
    src = pa.BufferReader(whole)
    reader = pa.ipc.open_stream(src)
    reader.read_next_batch()
    reader.read_next_batch()
    (tmp_path / "cut.arrow").write_bytes(whole[:src.tell()])
    assert pa.ipc.open_stream(pa.BufferReader(whole[:src.tell()])).read_all().num_rows == 4
    with pytest.raises(DatasetError, match=r"cut\.arrow: Arrow stream cut short after 4 rows"):
        TokenDataset(tmp_path / "cut.arrow")
    (tmp_path / "half.arrow").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(DatasetError, match=r"half\.arrow: not an Arrow IPC stream or file, or cut short"):
        TokenDataset(tmp_path / "half.arrow")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 but not really")
    with pytest.raises(DatasetError, match=r"junk\.parquet: not a readable parquet file"):
        TokenDataset(tmp_path / "junk.parquet")


def trainable(tmp_path, ids, masks, **kw) -> bool:
    ds = TokenDataset(write_stream(tmp_path / "t.arrow", table(ids=ids, masks=masks), chunk=2), **kw)
    try:
        ds.check_trainable()
    except DatasetError as e:
        assert "t.arrow: nothing to learn" in str(e)
        return False
    return True


def test_check_trainable_counts_only_anchors_the_loss_can_use(tmp_path):
    ids = [np.arange(2, 8), np.arange(2, 8), np.arange(2, 12)]
    # Each sample ends or starts supervised, so a pair straddles two samples: not an anchor.
    m = [np.array([0, 0, 0, 0, 0, 1]), np.array([1, 0, 1, 0, 1, 0]), np.array([0, 1, 0, 0, 0, 0, 0, 0, 1, 1])]
    assert trainable(tmp_path, ids, m)          # the last sample's final pair
    assert not trainable(tmp_path, ids, m, max_seq_len=8)                   # truncated away
    assert not trainable(tmp_path, ids, m, max_seq_len=8, overlong="drop")  # dropped
    assert trainable(tmp_path, ids[:2] + [ids[2][:6]], m[:2] + [np.array([0, 0, 1, 1, 0, 0])], max_seq_len=8)
    assert not trainable(tmp_path, ids, [np.zeros(len(s), np.int8) for s in ids])
    assert not trainable(tmp_path, [np.array([5])] * 3, [np.ones(1, np.int8)] * 3)
    assert not trainable(tmp_path, [np.array([5])] * 3, None)
    assert trainable(tmp_path, [np.array([5]), np.array([5, 6])], None)


def test_check_trainable_bool_masks(tmp_path):
    ids = [np.arange(2, 8), np.arange(2, 8)]
    t = table(ids=ids, masks=[np.array([1, 0, 1, 0, 1, 1]), np.zeros(6)], mask_type=pa.bool_())
    TokenDataset(write_stream(tmp_path / "b.arrow", t, chunk=1)).check_trainable()
    # The only supervised pair straddles the two samples (one chunk: no row boundary in the values).
    t = table(ids=ids, masks=[np.array([1, 0, 1, 0, 0, 1]), np.array([1, 0, 0, 0, 0, 1])], mask_type=pa.bool_())
    with pytest.raises(DatasetError, match=r"b2\.arrow: nothing to learn: no sample has 2 consecutive loss_mask=1"):
        TokenDataset(write_stream(tmp_path / "b2.arrow", t)).check_trainable()
