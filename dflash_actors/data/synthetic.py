"""The embedded default dataset, and a writer for HF ``save_to_disk``-style directories.

The synthetic language is a sparse first-order Markov chain: every word has
``branching`` possible successors with skewed probabilities (1/2, 1/4, ... normalised),
so the next token is mostly predictable and a drafter has something real to learn from
a thousand samples. (An order-2 chain over 253 words has 64k contexts: seen about twice
each in the demo data, it taught neither the tiny target nor the drafter anything.) Token ids:
0 = pad, 1 = eos (unused), 2..V-2 = words, V-1 = left free for the drafter's MASK.
A sample is a prompt (loss_mask 0) followed by a completion (loss_mask 1), both drawn
from the same chain.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..runtime.files import write_atomically

FIRST_WORD = 2
GRAMMAR_VERSION = 2   # part of the cache key: bump when generation changes


class MarkovGrammar:
    def __init__(self, vocab_size: int, branching: int, seed: int):
        self.vocab_size = vocab_size
        self.words = vocab_size - 3          # ids 2..V-2
        rng = np.random.default_rng([seed, 0xC0FFEE])
        self.successors = rng.integers(0, self.words, size=(self.words, branching))
        probs = 0.5 ** np.arange(branching)  # 1/2, 1/4, ... : skewed but not deterministic
        self.cum = np.cumsum(probs / probs.sum())

    def generate(self, lengths: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
        """One chain per requested length, vectorised across samples."""
        n, top = len(lengths), int(lengths.max())
        out = np.empty((n, top), np.int64)
        out[:, 0] = rng.integers(0, self.words, n)
        for t in range(1, top):
            choice = np.minimum(np.searchsorted(self.cum, rng.random(n), side="right"), len(self.cum) - 1)
            out[:, t] = self.successors[out[:, t - 1], choice]
        return [out[i, :lengths[i]] + FIRST_WORD for i in range(n)]


def _list_array(offsets: np.ndarray, values: np.ndarray, dtype) -> pa.ListArray:
    lo, hi = int(offsets[0]), int(offsets[-1])
    return pa.ListArray.from_arrays(pa.array((offsets - lo).astype(np.int32)), pa.array(values[lo:hi].astype(dtype)))


def write_token_dataset(path: str | Path, offsets: np.ndarray, input_ids: np.ndarray,
                        loss_mask: np.ndarray | None, num_shards: int = 1,
                        with_seq_len: bool = True, rows_per_batch: int = 1000) -> Path:
    """Write an HF ``save_to_disk``-compatible directory from flat arrays.

    ``offsets`` [N+1] delimit samples in ``input_ids``/``loss_mask``; the directory is
    written under a temporary name and renamed, so a reader never sees half of it.
    """
    return write_atomically(Path(path), lambda tmp: _write_dataset(tmp, offsets, input_ids, loss_mask, num_shards,
                                                                   with_seq_len, rows_per_batch))


def _write_dataset(tmp: Path, offsets, input_ids, loss_mask, num_shards, with_seq_len, rows_per_batch) -> None:
    tmp.mkdir()
    n = len(offsets) - 1
    bounds = np.linspace(0, n, num_shards + 1).astype(np.int64)
    files = []
    for s in range(num_shards):
        name = f"data-{s:05d}-of-{num_shards:05d}.arrow"
        files.append({"filename": name})
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        with pa.OSFile(str(tmp / name), "wb") as sink:
            writer = None
            for a in range(lo, hi, rows_per_batch):
                b = min(hi, a + rows_per_batch)
                off = offsets[a:b + 1]
                cols = {"input_ids": _list_array(off, input_ids, np.int32)}
                if loss_mask is not None:
                    cols["loss_mask"] = _list_array(off, loss_mask, np.int8)
                if with_seq_len:
                    cols["seq_len"] = pa.array(np.diff(off).astype(np.int64))
                batch = pa.RecordBatch.from_pydict(cols)
                if writer is None:
                    writer = pa.ipc.new_stream(sink, batch.schema)
                writer.write_batch(batch)
            if writer is not None:
                writer.close()
    (tmp / "state.json").write_text(json.dumps({
        "_data_files": files, "_fingerprint": "dflash-synthetic", "_format_columns": None,
        "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}))
    (tmp / "dataset_info.json").write_text(json.dumps({"description": "dflash-actors token dataset"}))


def flatten(samples: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(samples) + 1, np.int64)
    offsets[1:] = np.cumsum([len(s) for s in samples])
    return offsets, (np.concatenate(samples) if samples else np.zeros(0, np.int64))


def make_synthetic_samples(syn, n: int, seed_offset: int):
    """(input_ids, loss_mask) lists for ``n`` samples of the grammar ``syn`` describes."""
    grammar = MarkovGrammar(syn.vocab_size, syn.branching, syn.seed)
    rng = np.random.default_rng([syn.seed, seed_offset])
    p = rng.integers(syn.prompt_len[0], syn.prompt_len[1] + 1, n)
    c = rng.integers(syn.completion_len[0], syn.completion_len[1] + 1, n)
    ids = grammar.generate(p + c, rng)
    masks = [np.concatenate([np.zeros(a, np.int8), np.ones(b, np.int8)]) for a, b in zip(p, c)]
    return ids, masks


def ensure_synthetic_dataset(data_cfg) -> tuple[Path, Path]:
    """Generate (once, cached by config) the synthetic train and held-out directories."""
    syn = data_cfg.synthetic
    key = json.dumps([GRAMMAR_VERSION, syn.num_samples, syn.heldout_samples, syn.vocab_size, list(syn.prompt_len),
                      list(syn.completion_len), syn.branching, syn.seed])
    root = Path(data_cfg.cache_dir) / f"synthetic-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    train, heldout = root / "train", root / "heldout"
    for split, n, off in ((train, syn.num_samples, 1), (heldout, syn.heldout_samples, 2)):
        if (split / "state.json").is_file() or n == 0:
            continue
        ids, masks = make_synthetic_samples(syn, n, off)
        offsets, flat_ids = flatten(ids)
        write_token_dataset(split, offsets, flat_ids, flatten(masks)[1])
    return train, heldout


def train_path(cfg) -> Path:
    """The training dataset of a config: ``data.path``, or the synthetic default, made once."""
    return Path(cfg.data.path) if cfg.data.path is not None else ensure_synthetic_dataset(cfg.data)[0]
