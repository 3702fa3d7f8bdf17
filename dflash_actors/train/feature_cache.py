"""The feature cache (``target.feature_cache``): later epochs reuse the frozen target's
features instead of running it again on the same samples.

Canonical features. A sample's features depend on its tokens and, at float rounding, on
the batch it is packed with (the padded shape changes the kernels' blocking: 7 of 347
repeats of the tiny target differ in their last bits). What is cached therefore must not
depend on which process computed it first: the cached rows of sample s are its rows in
the forward of batch ``first(s)``, the smallest run batch id (``Schedule``'s one id space
over all epochs, dropped batches excluded) whose batch holds s. The plan is a pure
function of the schedule, so the pipeline, a restarted target, a resumed job and the
reference all use the same bits.

Plan (``plan_cache``): samples in increasing ``(first(s), place in that batch)`` are
cached until ``target.feature_cache_gb`` is used (tokens x width x element size); the
rest are computed in every batch that holds them.

Run batch g (``FeatureCache.features``):
  * cached samples with first(s) == g come out of g's forward and are stored, unless
    their entry is already present (a disk store kept from an earlier run, or a batch
    run again after its writer stored it and died): then they are served like the rest
    (``reused``), since the entry holds exactly the bits g's forward would give;
  * cached samples with first(s) < g are served from the store: a batch served
    entirely skips the target (the saving), otherwise its forward runs and their rows
    are replaced by the stored ones, so a batch's features never depend on timing;
  * a served sample whose entry is absent (its writer killed before the flag, a
    memory cache lost with its job, a first batch another target is still on) is a
    miss: this process assembles batch first(s) again from the dataset, runs it and
    stores its samples. It never waits for another actor.

Store layout (``MemoryStore``: shared host memory the job allocates and every target
maps; ``DiskStore``: the same as files under ``<run_dir>/feature-cache/``)::

    rows      [tokens, W]  dtype   cached slot k owns rows offsets[k] : offsets[k+1]
    present   [slots]      uint8   1 once slot k's rows are complete: the commit point
    header.json  (disk)            what the rows were computed from: data, target,
                                   layer ids, dtype, width, the plan's digest

An entry is committed per sample: rows first (synchronized on CUDA), then its flag, so a
writer killed halfway leaves the flag unset and the entry is recomputed. Two targets
that miss the same batch both write it; on one kind of device the bits are the same.
The disk store survives the job (a killed job's flags are in the page cache; a power cut
is outside what it promises); a header that does not match is discarded and rebuilt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..config import ConfigError
from ..data.batching import Batch, BatchBuffers, EpochPlan, assemble, plan_for
from ..data.dataset import open_dataset
from ..runtime.channels import DTYPES, page_lock
from ..runtime.files import write_atomically
from .schedule import Plans, Schedule

CACHE_DIR = "feature-cache"
HEADER = "header.json"
FORMAT = 1

COUNTERS = ("batches", "forwards", "forward_tokens", "forward_us", "skipped", "skipped_tokens", "repeats",
            "served", "missed", "recomputed", "stored", "reused")
"""Per target, in the shared counter table: batches featured, target forwards run (a
recompute included) with their tokens and microseconds, batches served without a
forward and their tokens, samples seen before (``repeats``), served from a present entry
(``served``) or after a recompute (``missed``), first batches recomputed, samples stored,
samples of their first batch served from an entry already present (``reused``)."""


def check(cfg) -> None:
    """ConfigError for a cache that cannot mean anything."""
    if cfg.target.feature_cache != "off" and cfg.runtime.simulate.enabled:
        raise ConfigError(f"target.feature_cache: {cfg.target.feature_cache} under runtime.simulate, whose target "
                          "computes no features (it waits and stamps); set target.feature_cache=off")


# ---------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class CachePlan:
    """Which samples are cached, where, and the batch whose forward is canonical."""

    first: np.ndarray       # int64 [dataset samples]: first run batch holding the sample; -1: none
    slot: np.ndarray        # int64 [dataset samples]: its slot in the store; -1: never cached
    offsets: np.ndarray     # int64 [slots + 1]: first row of each slot
    width: int
    dtype: str
    digest: str
    """sha256 of the cached samples, their lengths, their first batches and those
    batches' samples: what the canonical bits depend on beyond the data and the target."""

    @property
    def slots(self) -> int:
        return len(self.offsets) - 1

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def nbytes(self) -> int:
        return self.tokens * self.width * _element_size(self.dtype)


def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def _epoch_batches(plans: Sequence[EpochPlan], schedule: Schedule):
    """Per epoch: (its plan, its first run batch id, how many of its batches run)."""
    if schedule.nodes != 1:
        raise ValueError("the cache plan needs the whole run's schedule (node=None)")
    done = 0
    for plan, steps in zip(plans, schedule.steps_per_epoch):
        yield plan, schedule.first_of_step(done), steps * schedule.per_step
        done += steps


def plan_cache(plans: Sequence[EpochPlan], schedule: Schedule, lengths: np.ndarray, width: int, dtype: str,
               budget_bytes: float) -> CachePlan:
    """The cache plan of a run (module docstring); ``plans[e]`` is epoch e's plan and
    ``schedule`` the whole run's (``Schedule.from_epoch_sizes(cfg, sizes, None)``)."""
    n = len(lengths)
    first = np.full(n, -1, np.int64)
    place = np.zeros(n, np.int64)       # position in its first epoch's sample order
    for plan, start, count in _epoch_batches(plans, schedule):
        ids = plan.sample_ids[:plan.offsets[count]]
        batch = start + np.repeat(np.arange(count, dtype=np.int64), np.diff(plan.offsets[:count + 1]))
        new = first[ids] < 0
        first[ids[new]] = batch[new]
        place[ids[new]] = np.flatnonzero(new)
    seen = np.flatnonzero(first >= 0)
    order = seen[np.lexsort((place[seen], first[seen]))]
    per_token = width * _element_size(dtype)
    used = np.cumsum(lengths[order].astype(np.int64)) * per_token
    cached = order[:int(np.searchsorted(used, budget_bytes, side="right"))]
    slot = np.full(n, -1, np.int64)
    slot[cached] = np.arange(len(cached))
    offsets = np.concatenate([[0], np.cumsum(lengths[cached].astype(np.int64))])
    h = hashlib.sha256()
    h.update(cached.tobytes())
    h.update(first[cached].tobytes())
    h.update(offsets.tobytes())
    canonical = np.unique(first[cached])
    for plan, start, count in _epoch_batches(plans, schedule):
        for i in canonical[(canonical >= start) & (canonical < start + count)] - start:
            h.update(plan.batch(int(i)).tobytes())
    return CachePlan(first, slot, offsets, width, dtype, h.hexdigest())


# ---------------------------------------------------------------------------
# stores


class MemoryStore:
    """Rows and flags in host memory: shared (one segment the job allocates, which every
    target maps when the store is pickled to it) or private (the reference)."""

    def __init__(self, rows: torch.Tensor, flags: torch.Tensor):
        self.rows, self.flags = rows, flags
        self.present = flags.numpy()

    @classmethod
    def allocate(cls, plan: CachePlan, shared: bool = True) -> "MemoryStore":
        shape, dtype = (plan.tokens, plan.width), DTYPES[plan.dtype]
        if not shared:
            return cls(torch.zeros(shape, dtype=dtype), torch.zeros(plan.slots, dtype=torch.uint8))
        # Straight into a shared segment, as the rings are (channels): zero pages, no copy.
        rows = torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(max(1, plan.nbytes)), 0, shape)
        return cls(rows, torch.zeros(plan.slots, dtype=torch.uint8).share_memory_())

    def __getstate__(self):
        return {"rows": self.rows, "flags": self.flags}

    def __setstate__(self, state):
        self.__init__(state["rows"], state["flags"])

    def pin(self) -> None:
        page_lock([self.rows], "feature cache")


class DiskStore:
    """Rows and flags as files under ``root``, mapped by each process that unpickles it."""

    ROWS, FLAGS = "rows.bin", "present.bin"

    def __init__(self, root: Path, tokens: int, width: int, dtype: str, slots: int):
        self.root, self.shape = Path(root), (tokens, width, dtype, slots)
        row_bytes = width * _element_size(dtype)
        rows = np.memmap(self.root / self.ROWS, np.uint8, "r+", shape=(tokens, row_bytes))
        self.rows = torch.from_numpy(rows).view(DTYPES[dtype])
        self.present = np.memmap(self.root / self.FLAGS, np.uint8, "r+", shape=(slots,))

    def __getstate__(self):
        return {"root": self.root, "shape": self.shape}

    def __setstate__(self, state):
        self.__init__(state["root"], *state["shape"])

    def pin(self) -> None:
        """Not page-locked: that would pin the whole file in the page cache."""

    @classmethod
    def open(cls, root: Path, plan: CachePlan, header: dict) -> tuple["DiskStore", Optional[str]]:
        """The store at ``root`` for ``plan`` (kept if its header is ``header``, else
        discarded and made anew), and the one line saying what was discarded, if anything."""
        root = Path(root)
        found, line = root / HEADER, None
        if found.is_file():
            try:
                old = json.loads(found.read_text())
            except (OSError, ValueError):
                old = {}
            differ = sorted(k for k in header if old.get(k) != header[k])
            if not differ and cls._sized(root, plan):
                return cls(root, plan.tokens, plan.width, plan.dtype, plan.slots), None
            why = f"its {', '.join(differ)} differ" if differ else "its files have the wrong size"
            line = f"feature cache: {root} does not match this run ({why}); discarded, rebuilding it"
        elif root.exists():
            line = f"feature cache: {root} has no header (its writer was killed while creating it); rebuilding it"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        for name, size in ((cls.ROWS, plan.nbytes), (cls.FLAGS, plan.slots)):
            with open(root / name, "wb") as f:
                # Reserved now: a full disk then fails here, in one line, rather than as a
                # SIGBUS in whichever target first writes a page that has no block.
                try:
                    os.posix_fallocate(f.fileno(), 0, size)
                except OSError as e:
                    shutil.rmtree(root, ignore_errors=True)
                    raise ConfigError(f"target.feature_cache: disk cannot reserve {size / 1e9:.2f} GB under "
                                      f"{root} ({e.strerror}); lower target.feature_cache_gb or use memory") from None
        write_atomically(found, lambda tmp: tmp.write_text(json.dumps(header, indent=1)))
        return cls(root, plan.tokens, plan.width, plan.dtype, plan.slots), line

    @classmethod
    def _sized(cls, root: Path, plan: CachePlan) -> bool:
        try:
            return ((root / cls.ROWS).stat().st_size == plan.nbytes
                    and (root / cls.FLAGS).stat().st_size == plan.slots)
        except OSError:
            return False


# ---------------------------------------------------------------------------
# batches assembled again


class BatchSource:
    """Any run batch, assembled again from the dataset (a miss's first batch). Opens the
    dataset on first use: most targets never miss."""

    def __init__(self, cfg, train_path: str | Path, schedule: Schedule, dataset=None, plans: Optional[Plans] = None):
        self.cfg, self.train_path, self.schedule = cfg, str(train_path), schedule
        self._dataset, self._plans, self._buf = dataset, plans, None

    def __getstate__(self):
        return {"cfg": self.cfg, "train_path": self.train_path, "schedule": self.schedule}

    def __setstate__(self, state):
        self.__init__(**state)

    def batch(self, g: int) -> tuple[np.ndarray, np.ndarray, Batch]:
        """Run batch ``g`` (a whole-run id): its sample ids, ``cu_seqlens`` and the batch on CPU."""
        if self._dataset is None:
            self._dataset = open_dataset(self.cfg.data, progress=False, path=self.train_path)
        if self._plans is None:
            self._plans = Plans(self.cfg, self._dataset.lengths)
        if self._buf is None:
            self._buf = BatchBuffers.allocate(self.cfg.batching.token_budget, self.cfg.batching.max_samples)
        epoch, i = self.schedule.locate(g)
        ids = self._plans[epoch].batch(i)
        meta = assemble(self._dataset, ids, self._buf)
        return ids, self._buf.cu_seqlens[:meta.n_samples + 1].copy(), Batch.from_buffers(self._buf, meta)


# ---------------------------------------------------------------------------
# the cache


Forward = Callable[[Batch], torch.Tensor]


class FeatureCache:
    """A plan, its store, the recompute source and the shared counters (one row per
    writer). Pickles to the target actors with the store attached."""

    def __init__(self, mode: str, plan: CachePlan, store, source: BatchSource, counts: torch.Tensor):
        self.mode, self.plan, self.store, self.source, self.counts = mode, plan, store, source, counts

    def __getstate__(self):
        return {k: getattr(self, k) for k in ("mode", "plan", "store", "source", "counts")}

    def __setstate__(self, state):
        self.__init__(**state)

    def pin(self) -> None:
        """Page-lock the host rows for fast copies to a GPU (a no-op without CUDA)."""
        self.store.pin()

    def features(self, g: int, ids: np.ndarray, cu: np.ndarray, batch: Batch, forward: Forward,
                 device: torch.device, writer: int = 0, midway: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """Run batch ``g``'s features ``[T, W]`` on ``device``: stored rows where the plan
        caches a sample seen before, ``forward(batch)`` for the rest (module docstring).
        ``ids``/``cu``: the batch's sample ids and ``cu_seqlens`` (host); ``midway`` runs
        between a store's rows and its flags (a fault point)."""
        p, n = self.plan, np.zeros(len(COUNTERS), np.int64)
        slots, first = p.slot[ids], p.first[ids]
        starts, lens = cu[:-1], np.diff(cu)
        present = self.store.present[np.maximum(slots, 0)] != 0
        own = (slots >= 0) & (first == g)
        serve = (slots >= 0) & (first < g)
        absent = serve & ~present
        n[COUNTERS.index("batches")] = 1
        n[COUNTERS.index("repeats")] = int((first < g).sum())
        n[COUNTERS.index("served")] = int(serve.sum() - absent.sum())
        n[COUNTERS.index("missed")] = int(absent.sum())
        n[COUNTERS.index("reused")] = int((own & present).sum())
        serve |= own & present
        for h in np.unique(first[absent]):
            self._recompute(int(h), forward, n, midway)
        if serve.all():
            out = torch.empty((int(cu[-1]), p.width), dtype=DTYPES[p.dtype], device=device)
            n[COUNTERS.index("skipped")] = 1
            n[COUNTERS.index("skipped_tokens")] = int(cu[-1])
        else:
            out = self._forward(forward, batch, n)
        # Sample by sample: each one's rows are contiguous on both sides, so from a
        # page-locked store every copy to a GPU is one asynchronous DMA (the caller
        # synchronizes before its commit; present rows never change).
        rows, offsets = self.store.rows, p.offsets
        for k in np.flatnonzero(serve):
            o, m = offsets[slots[k]], lens[k]
            out[starts[k]:starts[k] + m].copy_(rows[o:o + m], non_blocking=True)
        if not serve.all():
            own &= ~present
            self._store(slots[own], out, starts[own], lens[own], n, midway)
        self.counts[writer] += torch.from_numpy(n)
        return out

    def _forward(self, forward: Forward, batch: Batch, n: np.ndarray) -> torch.Tensor:
        t0 = time.perf_counter()
        out = forward(batch)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        n[COUNTERS.index("forwards")] += 1
        n[COUNTERS.index("forward_tokens")] += out.shape[0]
        n[COUNTERS.index("forward_us")] += round((time.perf_counter() - t0) * 1e6)
        return out

    def _recompute(self, h: int, forward: Forward, n: np.ndarray, midway) -> None:
        """Batch h's forward again, from the dataset: the canonical bits of its samples."""
        ids, cu, batch = self.source.batch(h)
        out = self._forward(forward, batch, n)
        slots, first = self.plan.slot[ids], self.plan.first[ids]
        own = (slots >= 0) & (first == h)
        self._store(slots[own], out, cu[:-1][own], np.diff(cu)[own], n, midway)
        n[COUNTERS.index("recomputed")] += 1

    def _store(self, slots: np.ndarray, out: torch.Tensor, starts: np.ndarray, lens: np.ndarray, n: np.ndarray,
               midway) -> None:
        """Commit the rows ``out[starts[k]:starts[k]+lens[k]]`` as slot ``slots[k]``, those
        not present yet: rows, then (once they are in host memory) the flags."""
        new = self.store.present[slots] == 0
        if not new.any():
            return
        rows, offsets = self.store.rows, self.plan.offsets
        slots = slots[new]
        for s, o, m in zip(slots, starts[new], lens[new]):
            rows[offsets[s]:offsets[s] + m].copy_(out[o:o + m])
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        if midway is not None:
            midway()
        self.store.present[slots] = 1
        n[COUNTERS.index("stored")] += len(slots)

    def stats(self) -> dict:
        """The counters summed over writers, with the hit rate: samples served from a
        present entry over samples seen before. ``forward_saved_s`` estimates the target
        time the skipped batches would have taken, at the run's own seconds per token."""
        c = dict(zip(COUNTERS, self.counts.sum(0).tolist()))
        per_token = c["forward_us"] / c["forward_tokens"] * 1e-6 if c["forward_tokens"] else 0.0
        return {"mode": self.mode, "samples_cached": self.plan.slots,
                "samples": int((self.plan.first >= 0).sum()), "bytes": self.plan.nbytes,
                "entries_present": int(np.count_nonzero(self.store.present)),
                "batches": c["batches"], "forwards_skipped": c["skipped"], "samples_repeated": c["repeats"],
                "samples_served": c["served"], "misses": c["missed"], "first_batches_recomputed": c["recomputed"],
                "samples_stored": c["stored"], "samples_reused": c["reused"],
                "hit_rate": round(c["served"] / c["repeats"], 4) if c["repeats"] else None,
                "forward_s": round(c["forward_us"] * 1e-6, 3),
                "forward_saved_s": round(c["skipped_tokens"] * per_token, 3)}

    def describe(self) -> str:
        """One line: what is cached, and what a budget too small for all of it means."""
        st = self.stats()
        line = (f"feature cache ({self.mode}): {st['samples_cached']} of {st['samples']} samples, "
                f"{st['bytes'] / 1e6:.1f} MB")
        if st["samples_cached"] < st["samples"]:
            line += ("; target.feature_cache_gb holds only these: a batch skips the target only when all of its "
                     "samples are cached")
        return line

    def result_line(self) -> str:
        """How the cache did, in one line (the job's end)."""
        st = self.stats()
        rate = "-" if st["hit_rate"] is None else f"{100 * st['hit_rate']:.1f}%"
        return (f"  feature cache ({self.mode}): hit rate {rate} of repeated samples; {st['forwards_skipped']} of "
                f"{st['batches']} batches without a target forward (~{st['forward_saved_s']:.1f} s of target time "
                f"saved); {st['misses']} misses, {st['first_batches_recomputed']} first batches recomputed")


# ---------------------------------------------------------------------------
# building one


def whole_run(cfg, lengths: np.ndarray, plan0: Optional[EpochPlan] = None) -> tuple[list[EpochPlan], Schedule]:
    """Every epoch's plan and the whole run's schedule (all nodes as one machine)."""
    plans = [plan0 if e == 0 and plan0 is not None else plan_for(cfg, lengths, e) for e in range(cfg.train.epochs)]
    return plans, Schedule.from_epoch_sizes(cfg, [len(p) for p in plans], None)


def _plan(cfg, lengths: np.ndarray, plans: list[EpochPlan], schedule: Schedule, width: int,
          dtype: str) -> CachePlan:
    plan = plan_cache(plans, schedule, lengths, width, dtype, cfg.target.feature_cache_gb * 1e9)
    if plan.slots == 0:
        raise ConfigError(f"target.feature_cache_gb: {cfg.target.feature_cache_gb:g} GB holds no sample's features "
                          f"({width} x {dtype} per token); raise it or set target.feature_cache=off")
    return plan


def in_process(cfg, dataset, plans: Plans, width: int, dtype: str, root: Optional[Path] = None,
               layer_ids: Sequence[int] = ()) -> FeatureCache:
    """The cache of one process (the reference trainer): private memory, or with
    ``target.feature_cache: disk`` and a ``root``, the disk store under it, in the job's
    format (a later run over the same data, target and plan maps it instead of running
    the target again: the recipe bench shares one between its variants)."""
    check(cfg)
    all_plans = [plans[e] for e in range(cfg.train.epochs)]
    schedule = Schedule.from_epoch_sizes(cfg, [len(p) for p in all_plans], None)
    plan = _plan(cfg, dataset.lengths, all_plans, schedule, width, dtype)
    source = BatchSource(cfg, dataset.path, schedule, dataset, plans)
    if cfg.target.feature_cache == "disk" and root is not None:
        store, _ = DiskStore.open(Path(root) / CACHE_DIR, plan, _disk_header(cfg, dataset.path, plan, layer_ids))
    else:
        store = MemoryStore.allocate(plan, shared=False)
    return FeatureCache(cfg.target.feature_cache if root is not None else "memory", plan, store, source,
                        torch.zeros(1, len(COUNTERS), dtype=torch.int64))


def _disk_header(cfg, train_path: Path, plan: CachePlan, layer_ids: Sequence[int]) -> dict:
    """What a disk store's rows were computed from; a store whose header differs is rebuilt."""
    return {"format": FORMAT, "data": data_identity(cfg, train_path, plan.first.shape[0]),
            "target": target_identity(cfg), "layer_ids": list(layer_ids), "dtype": plan.dtype,
            "width": plan.width, "slots": plan.slots, "tokens": plan.tokens, "plan": plan.digest}


def plan_job(cfg, lengths: np.ndarray, plan0: EpochPlan, width: int, dtype: str) -> tuple[CachePlan, Schedule]:
    """The job's cache plan and the whole run's schedule; ConfigError for a cache that
    cannot work (under simulation, or a budget that holds no sample)."""
    check(cfg)
    plans, schedule = whole_run(cfg, lengths, plan0)
    return _plan(cfg, lengths, plans, schedule, width, dtype), schedule


def open_job(cfg, plan: CachePlan, schedule: Schedule, train_path: Path, layer_ids: list[int], run_dir: Path,
             writers: int) -> tuple[FeatureCache, Optional[str]]:
    """The job's cache, shared by its ``writers`` targets: the memory store allocated
    now, or the disk store under ``run_dir`` opened (kept if it matches, else rebuilt);
    and the line to show when an old disk cache was discarded."""
    line = None
    if cfg.target.feature_cache == "disk":
        store, line = DiskStore.open(Path(run_dir) / CACHE_DIR, plan, _disk_header(cfg, train_path, plan, layer_ids))
    else:
        store = MemoryStore.allocate(plan)
    counts = torch.zeros(writers, len(COUNTERS), dtype=torch.int64).share_memory_()
    return FeatureCache(cfg.target.feature_cache, plan, store, BatchSource(cfg, train_path, schedule), counts), line


def _files(root: Path) -> str:
    """Digest of the names, sizes and modification times of the files at ``root``."""
    root = Path(root)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    key = [(p.relative_to(root).as_posix() if p != root else p.name, p.stat().st_size, p.stat().st_mtime_ns)
           for p in files]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def data_identity(cfg, train_path: Path, samples: int) -> dict:
    """The training data, as caches here identify a file (path, sizes, mtimes), with how
    it is read (``data.max_seq_len``, ``data.overlong``); the plan's digest covers the
    samples' lengths and batches."""
    return {"path": str(Path(train_path).resolve()), "files": _files(train_path),
            "max_seq_len": cfg.data.max_seq_len, "overlong": cfg.data.overlong, "samples": int(samples)}


def target_identity(cfg) -> dict:
    """The target: its directory's files and the target config that loads it."""
    from ..models.target import ensure_target

    path = ensure_target(cfg)
    section = {k: v for k, v in dataclasses.asdict(cfg.target).items()
               if k not in ("feature_cache", "feature_cache_gb", "self_check")}
    return {"path": str(Path(path).resolve()), "files": _files(path),
            "config": hashlib.sha256(json.dumps(section, sort_keys=True).encode()).hexdigest()[:16]}
