"""Token-budget batch plans and allocation-free batch assembly.

Plan
----
``plan_epoch`` is a pure function of (lengths, batching config, seed, epoch): shuffle
all samples, cut the permutation into pools of ~``sort_pool`` batches' worth, sort each
pool by length (longest first) and fill batches greedily so that
``n_samples * longest <= token_budget``; finally shuffle the batch order. Sorting inside
pools keeps padding small while every epoch still mixes samples differently. A batch's
id is its position in the plan, so any actor can resume from a batch id.

Layout
------
A batch is stored *packed* (varlen): the samples' tokens back to back, with
``cu_seqlens`` marking sample boundaries and position ids restarting at 0 per sample::

    input_ids    [token_budget] int64   t0 t1 t2 | u0 u1 | v0 v1 v2 v3 | (unused)
    position_ids [token_budget] int64    0  1  2 |  0  1 |  0  1  2  3 |
    loss_mask    [token_budget] int8
    cu_seqlens   [max_samples+1] int32   0 3 5 9
    sample_ids   [max_samples] int64     dataset sample id of each row

Packed is the canonical form because the feature ring, by far the largest buffer,
then holds no padding, and the drafter works per sequence anyway. The target views it
as it needs: varlen kernels (flash-attn) take it as is; sdpa takes the right-padded
``[B, Lmax]`` form from ``Batch.padded()``. Right padding under a causal mask needs no
attention mask at all (real tokens never see the pads after them), which also sidesteps
transformers' packed-mask trap. Length grouping keeps that padded form >= 95% real.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ..runtime.channels import FieldSpec


@dataclass(frozen=True)
class EpochPlan:
    """CSR batches: batch b is ``sample_ids[offsets[b]:offsets[b+1]]``."""

    epoch: int
    sample_ids: np.ndarray      # int64, every planned sample once
    offsets: np.ndarray         # int64, len = n_batches + 1
    max_lens: np.ndarray        # int32, longest sample per batch

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def batch(self, b: int) -> np.ndarray:
        return self.sample_ids[self.offsets[b]:self.offsets[b + 1]]

    def stats(self, lengths: np.ndarray, token_budget: int) -> dict:
        counts = np.diff(self.offsets)
        real = int(lengths[self.sample_ids].sum(dtype=np.int64))
        padded = int((counts * self.max_lens.astype(np.int64)).sum())
        return {
            "batches": len(self),
            "samples": int(len(self.sample_ids)),
            "min_samples": int(counts.min()),
            "max_samples": int(counts.max()),
            "mean_samples": round(float(counts.mean()), 2),
            "padding_efficiency": round(real / padded, 4),     # real / [B, Lmax] slots
            "budget_fill": round(real / (len(self) * token_budget), 4),
        }


def plan_epoch(lengths: np.ndarray, token_budget: int, max_samples: int, sort_pool: int,
               seed: int, epoch: int) -> EpochPlan:
    n = len(lengths)
    if n == 0:
        raise ValueError("cannot plan an empty dataset")
    if int(lengths.max()) > token_budget:
        raise ValueError(f"a sample of {int(lengths.max())} tokens exceeds token_budget={token_budget}")
    rng = np.random.default_rng([seed, epoch, 0x5EED])
    perm = rng.permutation(n)
    per_batch = max(1, min(max_samples, token_budget // max(1, int(lengths.mean()))))
    pool = max(1, sort_pool * per_batch)
    ids, offsets, max_lens = [], [0], []
    for p in range(0, n, pool):
        members = perm[p:p + pool]
        members = members[np.argsort(-lengths[members], kind="stable")]
        lens = lengths[members]
        i = 0
        while i < len(members):
            longest = int(lens[i])
            k = min(token_budget // longest, max_samples, len(members) - i)
            ids.append(members[i:i + k])
            offsets.append(offsets[-1] + k)
            max_lens.append(longest)
            i += k
    order = rng.permutation(len(ids))
    counts = np.diff(offsets)[order]
    return EpochPlan(
        epoch=epoch,
        sample_ids=np.concatenate([ids[b] for b in order]).astype(np.int64),
        offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        max_lens=np.asarray(max_lens, np.int32)[order],
    )


def plan_for(cfg, lengths: np.ndarray, epoch: int) -> EpochPlan:
    """The plan a full ``Config`` implies for one epoch."""
    b = cfg.batching
    return plan_epoch(lengths, b.token_budget, b.max_samples, b.sort_pool, cfg.train.seed, epoch)


# ---------------------------------------------------------------------------
# assembly


# The packed fields, once: name, dtype, and how long the field is (per slot, and used).
TOKENS, SAMPLES, BOUNDARIES = "tokens", "samples", "samples+1"
BATCH_FIELDS = (("input_ids", "int64", TOKENS), ("position_ids", "int64", TOKENS), ("loss_mask", "int8", TOKENS),
                ("cu_seqlens", "int32", BOUNDARIES), ("sample_ids", "int64", SAMPLES))
FEATURES = "hidden"
"""The feature ring's extra field: the selected target layers, ``[T, W]``."""


def _extent(kind: str, tokens: int, samples: int) -> int:
    return {TOKENS: tokens, SAMPLES: samples, BOUNDARIES: samples + 1}[kind]


def ring_fields(token_budget: int, max_samples: int, feature_width: int = 0,
                feature_dtype: str = "float32") -> tuple[FieldSpec, ...]:
    """Slot layout of the batch ring, or with ``feature_width`` of the feature ring (the
    batch fields again, so its consumer needs no batch slot, plus the features)."""
    fields = tuple(FieldSpec(name, (_extent(kind, token_budget, max_samples),), dtype)
                   for name, dtype, kind in BATCH_FIELDS)
    if feature_width:
        fields += (FieldSpec(FEATURES, (token_budget, feature_width), feature_dtype),)
    return fields


@dataclass
class BatchBuffers:
    """Preallocated packed-batch storage; the arrays may be views of shared memory."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    cu_seqlens: np.ndarray
    sample_ids: np.ndarray

    @classmethod
    def allocate(cls, token_budget: int, max_samples: int) -> "BatchBuffers":
        return cls(**{name: np.zeros(_extent(kind, token_budget, max_samples), dtype)
                      for name, dtype, kind in BATCH_FIELDS})

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "BatchBuffers":
        """View CPU tensors (e.g. a shared-memory ring slot) as numpy without copying."""
        return cls(**{name: t[name].numpy() for name, _, _ in BATCH_FIELDS})


@dataclass(frozen=True)
class BatchMeta:
    """A batch's shape; travels in its ledger row (``as_ints``/``BatchMeta(*ints)``)."""

    n_samples: int
    n_tokens: int
    max_len: int

    def as_ints(self) -> tuple[int, int, int]:
        return self.n_samples, self.n_tokens, self.max_len


META_COLS = len(dataclasses.fields(BatchMeta))
"""Ledger meta columns a batch's shape takes."""


def copy_batch(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], meta: BatchMeta) -> None:
    """Copy a batch's packed fields, as far as they are used, from one slot to another."""
    for name, _, kind in BATCH_FIELDS:
        n = _extent(kind, meta.n_tokens, meta.n_samples)
        dst[name][:n].copy_(src[name][:n])


def assemble(dataset, sample_ids: np.ndarray, out: BatchBuffers) -> BatchMeta:
    """Write the samples, packed, into ``out``; allocates nothing proportional to tokens."""
    k = len(sample_ids)
    if k + 1 > len(out.cu_seqlens):
        raise ValueError(f"batch of {k} samples exceeds max_samples={len(out.cu_seqlens) - 1}")
    lengths = dataset.lengths[sample_ids]
    total = int(lengths.sum())
    if total > len(out.input_ids):
        raise ValueError(f"batch of {total} tokens exceeds the slot's {len(out.input_ids)} tokens")
    out.cu_seqlens[0] = 0
    np.cumsum(lengths, out=out.cu_seqlens[1:k + 1])
    dataset.gather(sample_ids, out.input_ids, out.loss_mask)
    pos = 0
    for n in lengths.tolist():
        out.position_ids[pos:pos + n] = _ARANGE[:n] if n <= len(_ARANGE) else np.arange(n)
        pos += n
    out.sample_ids[:k] = sample_ids
    return BatchMeta(n_samples=k, n_tokens=total, max_len=int(lengths.max()) if k else 0)


_ARANGE = np.arange(1 << 16, dtype=np.int64)


@dataclass
class Batch:
    """Torch views of an assembled packed batch (trimmed to its real extent)."""

    input_ids: torch.Tensor      # [T]
    position_ids: torch.Tensor   # [T]
    loss_mask: torch.Tensor      # [T]
    cu_seqlens: torch.Tensor     # [B+1]
    max_len: int

    @classmethod
    def from_buffers(cls, buf: BatchBuffers, meta: BatchMeta) -> "Batch":
        T, B = meta.n_tokens, meta.n_samples
        return cls(torch.from_numpy(buf.input_ids[:T]), torch.from_numpy(buf.position_ids[:T]),
                   torch.from_numpy(buf.loss_mask[:T]), torch.from_numpy(buf.cu_seqlens[:B + 1]),
                   meta.max_len)

    @classmethod
    def from_slot(cls, slot: dict[str, torch.Tensor], meta: BatchMeta) -> "Batch":
        """The batch in a ring slot, as views of the slot's tensors wherever they live
        (a feature ring in device memory too: no numpy on the way)."""
        T, B = meta.n_tokens, meta.n_samples
        return cls(slot["input_ids"][:T], slot["position_ids"][:T], slot["loss_mask"][:T],
                   slot["cu_seqlens"][:B + 1], meta.max_len)

    @property
    def n_samples(self) -> int:
        return len(self.cu_seqlens) - 1

    def to(self, device, non_blocking: bool = False) -> "Batch":
        mv = lambda t: t.to(device, non_blocking=non_blocking)
        return Batch(mv(self.input_ids), mv(self.position_ids), mv(self.loss_mask),
                     mv(self.cu_seqlens), self.max_len)

    def sequences(self):
        """(start, end) of each sample in the packed arrays."""
        cu = self.cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:]))

    def pad_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, col) of every packed token in the right-padded [B, max_len] layout."""
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        # output_size: no device sync to learn the length (and a trace needs none).
        row = torch.repeat_interleave(torch.arange(self.n_samples, device=lengths.device), lengths,
                                      output_size=len(self.input_ids))
        return row, self.position_ids

    def padded(self, pad_id: int = 0) -> torch.Tensor:
        """input_ids as right-padded [B, max_len] (pads sit after each sample)."""
        row, col = self.pad_index()
        out = self.input_ids.new_full((self.n_samples, self.max_len), pad_id)
        out[row, col] = self.input_ids
        return out
