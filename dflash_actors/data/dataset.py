"""Tokenized datasets, opened by memory map and never materialized.

Accepted inputs:
  * a directory written by HF ``datasets.save_to_disk`` (``state.json`` naming one or
    more ``data-XXXXX-of-YYYYY.arrow`` IPC *stream* shards), or a directory of ``.arrow``;
  * a single ``.arrow`` file, IPC stream or IPC file format;
  * a ``.parquet`` file (decoded once into Arrow buffers: parquet pages are compressed,
    so it cannot be mapped; still no Python objects per token).

Columns: ``input_ids`` (list<int32|int64>), optional ``loss_mask`` (list<int8|bool|int>,
defaults to all ones) and optional ``seq_len`` (checked against the real length).

What ``open`` holds per sample is one int32 (the usable length) and, only when samples
were dropped, one int64 (the raw row). Token and mask values stay in the mapped file;
``gather`` reads them through per-chunk numpy views of the Arrow offsets/values
buffers, indexing the child buffer with absolute offsets (``ListArray.values`` ignores a
slice's offset, so offsets are never rebased).
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import console
from ..console import first_line

ARROW_FILE_MAGIC = b"ARROW1"
ARROW_STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"
"""What a closed IPC stream writer writes last (continuation token, length 0)."""


class DatasetError(ValueError):
    """Bad dataset input; the message names the file and the first bad row."""


@dataclass
class _Chunk:
    """One record batch: numpy views of its list offsets and values."""

    file: str
    first_row: int          # row of this chunk within its file
    ids_offsets: np.ndarray
    ids_values: np.ndarray
    mask_offsets: np.ndarray | None
    mask_values: np.ndarray | pa.Array | None   # pa.Array when bool (bit-packed)


def _list_views(arr: pa.Array, file: str, first_row: int, col: str):
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise DatasetError(f"{file}: column {col!r} must be a list of integers (got {arr.type})")
    if arr.null_count:
        row = first_row + int(np.flatnonzero(~arr.is_valid().to_numpy(zero_copy_only=False))[0])
        raise DatasetError(f"{file}: row {row}: {col} is null")
    offsets = arr.offsets.to_numpy(zero_copy_only=True)
    child = arr.values
    vt = child.type
    if pa.types.is_boolean(vt):
        values = child            # bit-packed: sliced and unpacked per sample on read
    elif pa.types.is_integer(vt):
        values = child.to_numpy(zero_copy_only=True)
    else:
        raise DatasetError(f"{file}: column {col!r} must hold integers (got list<{vt}>)")
    return offsets, values


def _read_table(path: Path) -> pa.Table:
    """Memory-map an Arrow stream/file shard (zero copy) or decode a parquet file."""
    if path.suffix == ".parquet":
        try:
            return pq.read_table(path, memory_map=True)
        except (pa.ArrowException, OSError) as e:
            raise DatasetError(f"{path}: not a readable parquet file ({first_line(e)})") from None
    # Python's mmap behind a BufferReader rather than pa.memory_map: the latter advises
    # the kernel to read ahead every region it reads, which makes open cost grow with
    # the file's size (measured ~10x slower on a 1.6 GB dataset); this stays zero-copy.
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise DatasetError(f"{path}: empty file")
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    source = pa.BufferReader(pa.py_buffer(mapped))
    try:
        if mapped[:len(ARROW_FILE_MAGIC)] == ARROW_FILE_MAGIC:
            return pa.ipc.open_file(source).read_all()
        table = pa.ipc.open_stream(source).read_all()
    except (pa.ArrowException, OSError) as e:   # a cut-off body is an OSError, random bytes too
        raise DatasetError(f"{path}: not an Arrow IPC stream or file, or cut short ({first_line(e)})") from None
    # A stream cut at a message boundary reads without error, minus its tail: only the
    # end-of-stream marker that every closed writer leaves tells the two apart.
    end = source.tell()
    if mapped[end - len(ARROW_STREAM_END):end] != ARROW_STREAM_END:
        raise DatasetError(f"{path}: Arrow stream cut short after {table.num_rows} rows "
                           "(no end-of-stream marker: a truncated copy or an unfinished write?)")
    return table


def _shard_paths(path: Path) -> list[Path]:
    if not path.exists():
        raise DatasetError(f"{path}: dataset not found")
    if path.is_file():
        if path.suffix not in (".arrow", ".parquet"):
            raise DatasetError(f"{path}: expected a save_to_disk directory, .arrow or .parquet")
        return [path]
    state = path / "state.json"
    if state.is_file():
        try:
            files = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise DatasetError(f"{state}: unreadable save_to_disk state ({e!r})") from None
        shards = [path / f for f in files]
        missing = [s for s in shards if not s.is_file()]
        if missing:
            raise DatasetError(f"{missing[0]}: listed in state.json but missing")
    else:
        shards = sorted(path.glob("*.arrow")) or sorted(path.glob("*.parquet"))
    if not shards:
        raise DatasetError(f"{path}: no .arrow or .parquet shards in this directory")
    return shards


class TokenDataset:
    """A read-only, memory-mapped view of tokenized samples.

    ``lengths[i]`` is sample i's length after ``max_seq_len`` handling; sample ids are
    positions among the kept samples.
    """

    def __init__(self, path: str | Path, max_seq_len: int | None = None,
                 overlong: str = "truncate", progress: bool = True):
        self.path = Path(path)
        self._tables: list[pa.Table] = []   # keep the maps alive
        self._chunks: list[_Chunk] = []
        raw_lengths: list[np.ndarray] = []
        self.has_loss_mask = True
        shards = _shard_paths(self.path)
        with console.progress(len(shards), "open dataset", "shards", progress) as bar:
            for shard in shards:
                table = _read_table(shard)
                self._tables.append(table)
                raw_lengths.extend(self._add_shard(str(shard), table))
                bar.update(1)
        lengths = np.concatenate(raw_lengths) if raw_lengths else np.zeros(0, np.int64)
        if len(lengths) == 0:
            raise DatasetError(f"{self.path}: dataset has no samples")
        # Map each raw row to its chunk and row-in-chunk, lazily, via chunk row starts.
        self._chunk_rows = np.cumsum([0] + [len(c.ids_offsets) - 1 for c in self._chunks])
        self.n_truncated = self.n_dropped = 0
        self._kept: np.ndarray | None = None
        if max_seq_len is not None:
            over = lengths > max_seq_len
            if overlong == "drop":
                self.n_dropped = int(over.sum())
                if self.n_dropped:
                    self._kept = np.flatnonzero(~over)
                    lengths = lengths[self._kept]
                    if len(lengths) == 0:
                        raise DatasetError(f"{self.path}: every sample is longer than max_seq_len={max_seq_len}")
            elif overlong == "truncate":
                self.n_truncated = int(over.sum())
                lengths = np.minimum(lengths, max_seq_len)
            else:
                raise ValueError(f"overlong must be 'truncate' or 'drop' (got {overlong!r})")
        self.lengths = lengths.astype(np.int32)

    # -- opening --------------------------------------------------------------

    def _add_shard(self, file: str, table: pa.Table) -> list[np.ndarray]:
        cols = table.column_names
        if "input_ids" not in cols:
            raise DatasetError(f"{file}: missing column 'input_ids' (columns: {cols})")
        has_mask = "loss_mask" in cols
        if self._chunks and has_mask != self.has_loss_mask:
            raise DatasetError(f"{file}: loss_mask present in some shards but not others")
        self.has_loss_mask = has_mask
        ids_col = table.column("input_ids")
        mask_col = table.column("loss_mask") if has_mask else None
        seq_col = table.column("seq_len") if "seq_len" in cols else None
        out, row = [], 0
        # Writers chunk all columns alike; if not, align loss_mask on input_ids' chunks
        # (that fallback copies the mask, once).
        aligned = mask_col is not None and [len(c) for c in mask_col.chunks] == [len(c) for c in ids_col.chunks]
        for k, ids_chunk in enumerate(ids_col.chunks):
            n = len(ids_chunk)
            ids_off, ids_val = _list_views(ids_chunk, file, row, "input_ids")
            lengths = ids_off[1:] - ids_off[:-1]
            if not lengths.all():
                raise DatasetError(f"{file}: row {row + int(np.argmin(lengths))}: empty sample (0 tokens)")
            mask_off = mask_val = None
            if mask_col is not None:
                mask_chunk = mask_col.chunk(k) if aligned else mask_col.slice(row, n).combine_chunks()
                mask_off, mask_val = _list_views(mask_chunk, file, row, "loss_mask")
                mismatch = (mask_off[1:] - mask_off[:-1]) != lengths
                if mismatch.any():
                    r = int(np.argmax(mismatch))
                    raise DatasetError(
                        f"{file}: row {row + r}: input_ids has {lengths[r]} tokens but loss_mask has "
                        f"{int(mask_off[r + 1] - mask_off[r])}")
            if seq_col is not None:
                seq = seq_col.slice(row, n).to_numpy()
                mismatch = seq != lengths
                if mismatch.any():
                    r = int(np.argmax(mismatch))
                    raise DatasetError(
                        f"{file}: row {row + r}: seq_len says {seq[r]} but input_ids has {lengths[r]} tokens")
            self._chunks.append(_Chunk(file, row, ids_off, ids_val, mask_off, mask_val))
            out.append(lengths)
            row += n
        return out

    # -- access ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(chunk index, row within chunk) for many sample ids at once."""
        raw = self._kept[ids] if self._kept is not None else np.asarray(ids)
        c = np.searchsorted(self._chunk_rows, raw, side="right") - 1
        return c, raw - self._chunk_rows[c]

    def gather(self, ids: np.ndarray, ids_out: np.ndarray, mask_out: np.ndarray) -> None:
        """Copy samples ``ids`` back to back into ``ids_out``/``mask_out`` (packed)."""
        lengths = self.lengths[ids].tolist()
        chunk_idx, rows = self.locate(ids)
        chunks = self._chunks
        pos = 0
        for n, c, r in zip(lengths, chunk_idx.tolist(), rows.tolist()):
            chunk = chunks[c]
            a = int(chunk.ids_offsets[r])
            ids_out[pos:pos + n] = chunk.ids_values[a:a + n]
            if chunk.mask_offsets is None:
                mask_out[pos:pos + n] = 1
            else:
                m = int(chunk.mask_offsets[r])
                vals = chunk.mask_values
                if isinstance(vals, pa.Array):
                    mask_out[pos:pos + n] = vals.slice(m, n).to_numpy(zero_copy_only=False)
                else:
                    mask_out[pos:pos + n] = vals[m:m + n]
            pos += n

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """One sample as fresh arrays (tests, evaluation; not the hot path)."""
        n = int(self.lengths[i])
        ids, mask = np.empty(n, np.int64), np.empty(n, np.int8)
        self.gather(np.array([i]), ids, mask)
        return ids, mask

    def supervised_tokens(self) -> np.ndarray:
        """The sorted token ids found at loss_mask=1 positions of any raw row (every
        token without a loss_mask). Truncated tails and dropped rows count too: a
        superset of what training labels, which is all a restricted head needs. One
        vectorised pass marking a table (a sort per chunk would cost minutes at scale)."""
        seen = np.zeros(0, bool)
        for c in self._chunks:
            ids = c.ids_values[c.ids_offsets[0]:c.ids_offsets[-1]]
            if c.mask_offsets is not None:
                a, b = int(c.mask_offsets[0]), int(c.mask_offsets[-1])
                m = c.mask_values
                m = (m.slice(a, b - a).to_numpy(zero_copy_only=False) if isinstance(m, pa.Array) else m[a:b])
                ids = ids[m.astype(bool)]
            if len(ids):
                top = int(ids.max()) + 1
                if top > len(seen):
                    seen = np.concatenate([seen, np.zeros(top - len(seen), bool)])
                seen[ids] = True
        return np.flatnonzero(seen).astype(np.int64)

    # -- full validation (one vectorised pass over the values) ----------------

    def check_values(self, vocab_size: int, progress: bool = True) -> None:
        """Token ids in [0, vocab_size) and loss_mask in {0, 1}; first bad row named.

        Kept separate from open because it reads every token (~GB/s, vectorised), while
        open reads only offsets.
        """
        total = int(sum(int(c.ids_offsets[-1] - c.ids_offsets[0]) for c in self._chunks))
        with console.progress(total, "check tokens", "tok", progress, unit_scale=True) as bar:
            for c in self._chunks:
                self._check_range(c, c.ids_offsets, c.ids_values, 0, vocab_size - 1, "input_ids",
                                  f"outside [0, {vocab_size})")
                if c.mask_offsets is not None and not isinstance(c.mask_values, pa.Array):
                    self._check_range(c, c.mask_offsets, c.mask_values, 0, 1, "loss_mask", "not 0 or 1")
                bar.update(int(c.ids_offsets[-1] - c.ids_offsets[0]))

    def check_trainable(self) -> None:
        """Raise unless some sample has an anchor: a position a < length-1 with
        ``loss_mask[a] = loss_mask[a+1] = 1`` (the loss trains on nothing else).

        Stops at the first anchor found, so a usual dataset costs one window; one with
        none costs a vectorised pass over the masks, in bounded windows.
        """
        if not self.has_loss_mask:
            if (self.lengths >= 2).any():
                return
            raise DatasetError(f"{self.path}: nothing to learn: every sample is 1 token long "
                               "(an anchor needs 2 consecutive supervised tokens)")
        used = self.lengths     # per raw row: length after truncation, 0 if dropped
        if self._kept is not None:
            used = np.zeros(self._chunk_rows[-1], np.int32)
            used[self._kept] = self.lengths
        for c, chunk in enumerate(self._chunks):
            rows = used[self._chunk_rows[c]:self._chunk_rows[c + 1]]
            if rows.max(initial=0) >= 2 and self._has_anchor(chunk, rows):   # dropped samples: unread
                return
        raise DatasetError(f"{self.path}: nothing to learn: no sample has 2 consecutive loss_mask=1 positions "
                           "(an anchor needs loss_mask[a] = loss_mask[a+1] = 1)")

    @staticmethod
    def _has_anchor(c: _Chunk, used: np.ndarray) -> bool:
        offsets, values = c.mask_offsets, c.mask_values
        a, b = int(offsets[0]), int(offsets[-1])
        step = 1 << 22   # bound the temporaries
        for s in range(a, b, step):
            e = min(b, s + step + 1)    # one past the window: pairs straddle its end
            v = values.slice(s, e - s).to_numpy(zero_copy_only=False) if isinstance(values, pa.Array) \
                else values[s:e]
            m = v != 0
            pos = s + np.flatnonzero(m[:-1] & m[1:])
            if len(pos) == 0:
                continue
            # A pair counts only inside one sample's used length: not across two
            # samples, not past a truncation, not in a dropped sample.
            r = np.searchsorted(offsets, pos, side="right") - 1
            if (pos + 1 < offsets[r] + used[r]).any():
                return True
        return False

    @staticmethod
    def _check_range(c: _Chunk, offsets, values, lo, hi, col, what):
        a, b = int(offsets[0]), int(offsets[-1])
        step = 1 << 24   # bound the temporary boolean array
        for s in range(a, b, step):
            v = values[s:min(b, s + step)]
            if v.min() < lo or v.max() > hi:
                pos = s + int(np.flatnonzero((v < lo) | (v > hi))[0])
                r = int(np.searchsorted(offsets, pos, side="right")) - 1
                raise DatasetError(f"{c.file}: row {c.first_row + r}: {col} value {int(values[pos])} {what}")


def open_dataset(cfg_data, progress: bool = True, path: str | Path | None = None) -> TokenDataset:
    """Open the dataset a ``DataConfig`` names (``path`` overrides, e.g. the synthetic one)."""
    return TokenDataset(path or cfg_data.path, max_seq_len=cfg_data.max_seq_len,
                        overlong=cfg_data.overlong, progress=progress)
