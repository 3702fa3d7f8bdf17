"""Checkpoints: ``<run_dir>/checkpoints/step-NNNNNNN/`` written atomically, with checksums.

Each holds the HF drafter directory (config.json + model.safetensors, loadable by
z-lab's DFlashDraftModel), ``trainer_state.pt`` (optimizer, scheduler, step, epoch,
next batch id, RNG, config) and ``manifest.json``, the size and SHA-256 of every other
file. A checkpoint is built under a hidden temporary name; the manifest is written last,
then every file is fsynced and the directory renamed into place, so a directory named
``step-*`` is complete by construction. A write killed halfway leaves only a
``.tmp-step-*-PID``: the next save removes those of writers that are gone, and the job
removes all of them once no actor is left. A write that fails (a full disk) removes its
own temporary directory and raises; the previous checkpoint is untouched.

Completeness is not integrity: bits flip on disks and in copies. ``checkpoint_problem``
checks a checkpoint against its manifest, and ``latest_checkpoint`` returns the newest
one that passes; a resume skips the others, saying why. Checkpoints written before
manifests existed are accepted unchecked (``has_manifest`` tells them apart).

A manifest proves a file intact, not that this trainer wrote it: whoever can write a run
directory can rewrite its manifest too. So ``trainer_state.pt`` is read as data, never
run: its pickle is first read without unpickling, and one that names anything beyond
``STATE_GLOBALS`` (what tensors, numbers, strings, lists and dicts pickle to) is refused
with ``ForeignFileError``; the rest is unpickled by torch's weights-only unpickler, which
builds only tensors and plain containers. A foreign file is not damage: a resume stops
on it rather than passing over it to an older checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickletools
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional

import torch

from ..console import first_line
from ..runtime.files import write_atomically

STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
# SHA-256: OpenSSL runs it on the CPU's SHA extensions (x86 SHA-NI, ARMv8 crypto), ~0.9
# GB/s per core here against ~0.35 for BLAKE2b, which has none; and `sha256sum` can check
# a manifest by hand. A checksum against bit rot needs no more than that.
HASH = "sha256"
_STEP_DIR = re.compile(r"^step-(\d{7,})$")
_TMP_DIR = re.compile(r"^\.tmp-step-\d+-(\d+)$")

STATE_GLOBALS = frozenset({"torch._utils._rebuild_tensor_v2", "torch.FloatStorage", "collections.OrderedDict"})
"""Every global that ``torch.save`` names in the pickle of a trainer state: float32
tensors (the optimizer moments; an ``OrderedDict`` is part of how a tensor pickles);
everything else in it is ints, floats, strings, None, lists, tuples and dicts, which
need none. ``trainer_state`` writes nothing more; a test holds it to that."""
_LEGACY_PICKLES = 5
"""torch's pre-zip format opens with five pickles (magic number, protocol, system info,
the object, its storage keys), then raw storage bytes."""

# Keys that may change between a run and its resume without changing the math.
RESUME_FREE = ("runtime.", "topology.num_targets", "topology.target_tp", "topology.target_devices",
               "topology.drafter_devices", "train.checkpoint_every", "train.max_bad_steps", "data.cache_dir",
               "target.self_check", "eval.", "monitor.")
NOT_FREE = ("runtime.simulate.",)
CACHE_KEY = "target.feature_cache"
"""Exceptions to RESUME_FREE: simulated gradients are not the real ones."""


class ResumeError(ValueError):
    """A resume that would not continue the same training; the message says why."""


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read; the message names it."""


class ForeignFileError(ValueError):
    """A checkpoint file whose pickle names code a trainer state never holds: written
    by someone else, not damaged. Nothing in it has run; the message names the file."""


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, HASH).hexdigest()     # reads 256 KiB at a time: GB files stream


def _write_manifest(d: Path) -> None:
    files = {p.relative_to(d).as_posix(): {"bytes": p.stat().st_size, HASH: _digest(p)}
             for p in sorted(d.rglob("*")) if p.is_file()}
    (d / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | Path, step: int, write_drafter: Callable[[Path], None],
                    trainer_state: dict) -> Path:
    """Write ``step-NNNNNNN`` atomically; ``write_drafter(dir)`` saves the HF directory.

    A failing write (OSError ENOSPC on a full disk) removes its temporary directory and
    raises: whether a missed checkpoint stops the job is the caller's decision."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    _remove_orphans(root)

    def write(tmp: Path) -> None:
        tmp.mkdir()
        write_drafter(tmp)
        torch.save(trainer_state, tmp / STATE_FILE)
        _write_manifest(tmp)
    # The writer's pid in the name: a replacement never writes into a dead writer's
    # files. The same step saved again (a damaged one) replaces it.
    return write_atomically(root / f"step-{step:07d}", write, tmp=root / f".tmp-step-{step:07d}-{os.getpid()}",
                            durable=True)


def _remove_orphans(root: Path) -> None:
    """Temporary directories of writers that died mid-write (a replacement optimizer
    writes under its own pid, so nothing else would ever remove them)."""
    for p in root.glob(".tmp-step-*"):
        m = _TMP_DIR.match(p.name)
        if m is None or not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Every complete ``step-*`` directory, oldest first, verified or not."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def remove_partial(run_dir: str | Path) -> list[Path]:
    """Delete every ``.tmp-*`` leftover (call it only while nothing writes checkpoints)."""
    root = checkpoint_root(run_dir)
    gone = [p for p in root.glob(".tmp-step-*")] if root.is_dir() else []
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def has_manifest(ckpt: Path) -> bool:
    return (Path(ckpt) / MANIFEST).is_file()


def checkpoint_problem(ckpt: Path, unchecked_ok: bool = True) -> str | None:
    """Why ``ckpt`` fails its manifest, in a phrase naming the file; None when every file
    listed has its recorded size and hash, or when there is no manifest and
    ``unchecked_ok`` (a checkpoint from before checksums)."""
    ckpt = Path(ckpt)
    if not has_manifest(ckpt):
        return None if unchecked_ok else f"{MANIFEST} is missing"
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
        listed = [(str(name), int(e["bytes"]), str(e[HASH])) for name, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is unreadable"
    if STATE_FILE not in files:
        return f"{MANIFEST} does not list {STATE_FILE}"
    outside = [name for name, _, _ in listed if Path(name).is_absolute() or ".." in Path(name).parts]
    if outside:
        return f"{MANIFEST} names a file outside the checkpoint ({outside[0]})"
    for name, size, digest in listed:
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        have = path.stat().st_size
        if have != size:        # cheap, and the usual damage: a truncated copy
            return f"{name} has {have} bytes, its manifest says {size}"
        if _digest(path) != digest:
            return f"{name} does not match its checksum"
    return None


def _newest_first(run_dir: str | Path) -> list[tuple[Path, bool]]:
    """Every complete checkpoint, newest first, with whether it may lack a manifest:
    only if no older one has one. This code always writes one, so a manifest-less
    checkpoint newer than a checked one was not written by it (or lost its manifest)."""
    found = list_checkpoints(run_dir)
    first = next((i for i, p in enumerate(found) if has_manifest(p)), len(found))
    return [(p, i <= first) for i, p in reversed(list(enumerate(found)))]


def verified_checkpoint(run_dir: str | Path, step: int) -> Path | None:
    """``step-NNNNNNN`` if it is complete and passes its manifest."""
    name = f"step-{step:07d}"
    for p, unchecked_ok in _newest_first(run_dir):
        if p.name == name:
            return p if checkpoint_problem(p, unchecked_ok) is None else None
    return None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint that passes its manifest (or is from before manifests);
    damaged ones are passed over."""
    for p, unchecked_ok in _newest_first(run_dir):
        if checkpoint_problem(p, unchecked_ok) is None:
            return p
    return None


@dataclass
class Found:
    """What ``newest_usable`` found: the checkpoint (None when none would do), what
    ``load`` made of it, and each newer one passed over with the reason."""

    path: Optional[Path]
    loaded: Any
    skipped: list[tuple[Path, str]]


def newest_usable(run_dir: str | Path, load: Callable[[Path], Any]) -> Found:
    """The newest checkpoint that passes its manifest and that ``load`` loads.

    ``load`` may raise anything a damaged file makes a loader raise (pickle, zip,
    safetensors and JSON errors have no common base); that checkpoint is then passed
    over, the error's first line recorded. A checkpoint without a manifest can only be
    judged this way. ``ForeignFileError`` is not damage: it propagates, so that a
    planted file stops the resume instead of being stepped around."""
    skipped = []
    for p, unchecked_ok in _newest_first(run_dir):
        why = checkpoint_problem(p, unchecked_ok)
        if why is None:
            try:
                return Found(p, load(p), skipped)
            except ForeignFileError:
                raise
            except Exception as e:  # noqa: BLE001 - see the docstring
                why = first_line(e)
        skipped.append((p, why))
    return Found(None, None, skipped)


def _pickles(f: IO[bytes]) -> Iterator[IO[bytes]]:
    """The pickle streams ``torch.load`` would unpickle from ``f``: each ``.pkl`` record
    of a zip archive (``torch.save``'s format, whose pickle is ``data.pkl``), else the
    file itself, read as torch's older format."""
    if zipfile.is_zipfile(f):
        with zipfile.ZipFile(f) as z:
            for info in z.infolist():
                if info.filename.endswith(".pkl"):
                    yield io.BytesIO(z.read(info))      # checks the record's CRC-32 too
        return
    f.seek(0)
    for _ in range(_LEGACY_PICKLES):
        yield f


def _named(stream: IO[bytes]) -> Iterator[str]:
    """Every global one pickle names, in order, read with ``pickletools`` (which unpickles
    nothing). ``torch.save`` (protocol 2) names globals with ``GLOBAL`` only; any other
    way of naming one is yielded too, by its module and name where they can be seen."""
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(stream):
        if op.name in ("GLOBAL", "INST"):
            yield arg.replace(" ", ".")
        elif op.name == "STACK_GLOBAL":
            yield ".".join(strings[-2:]) if len(strings) >= 2 else op.name
        elif op.name in ("OBJ", "EXT1", "EXT2", "EXT4"):
            yield op.name
        elif isinstance(arg, str):
            strings.append(arg)


def foreign_globals(path: Path, allowed: frozenset[str] = STATE_GLOBALS) -> list[str]:
    """The globals beyond ``allowed`` that the pickles of ``path`` name, sorted; empty
    for a file of this trainer's. Reading stops where a damaged pickle stops parsing
    (what came before still counts); damage itself is the loader's to report.
    OSError and zip errors propagate."""
    found: set[str] = set()
    with open(path, "rb") as f:
        for stream in _pickles(f):
            try:
                found.update(n for n in _named(stream) if n not in allowed)
            except (ValueError, EOFError, UnicodeDecodeError):   # not a pickle (any more)
                break
    return sorted(found)


def load_trainer_state(ckpt: Path) -> dict:
    """The trainer state in ``ckpt``: ForeignFileError if its pickle names anything
    beyond ``STATE_GLOBALS`` (nothing of it is run), CheckpointError if it cannot be
    read. Unpickled with ``weights_only=True`` as well, so a pickle that the check
    above misreads still runs no code."""
    path = Path(ckpt) / STATE_FILE
    try:
        foreign = foreign_globals(path)
        if not foreign:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file raises RuntimeError, UnpicklingError, EOFError, ...
        raise CheckpointError(f"{path}: cannot be loaded ({first_line(e)})") from None
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" (+{len(foreign) - 3} more)" if len(foreign) > 3 else "")
        raise ForeignFileError(f"{path}: refused: its pickle names {shown}, which no trainer state holds "
                               "(a file this trainer did not write; nothing in it was run)")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a trainer state")
    return state


def trainer_state(cfg, schedule, store, version: int) -> dict:
    """What ``trainer_state.pt`` holds for weight version ``version`` (= optimizer steps).

    No RNG state is saved because none is carried: every random choice is derived from
    ``(train.seed, epoch, batch id, row)``, so the next batch id is all a resume needs.
    ``batches_applied`` is the store's count of the batches the steps consumed (checked
    per step, carried across resumes): equal to ``next_batch`` when none was lost or
    trained twice.
    """
    exp_avg, exp_avg_sq = (t.clone() for t in store.moments_flat(version))
    return {
        "step": version, "epoch": schedule.epoch_of_step(version), "next_batch": version * schedule.batches_per_step,
        "total_steps": schedule.total_steps, "batches_applied": store.applied(version),
        "optimizer": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "param_names": list(store.layout.names),
                      "adam_step": version},
        "scheduler": {"last_epoch": version},
        "rng": {"seed": cfg.train.seed, "derived_from": "(seed, epoch, batch_id, row)"},
        "config": cfg.to_dict(), "config_hash": cfg.digest(),
    }


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


PER_STEP = "batches per step (train.grad_accum * topology.num_drafters * topology.nodes)"
"""What a step consumes: the math's unit. A resume may trade drafters for accumulation
(2 drafters x 1 batch = 1 drafter x 2 batches) with the same data order and optimizer
state; only the order in which the gradient sum is added up changes."""


PER_STEP_PARTS = ("train.grad_accum", "topology.num_drafters", "topology.nodes")


def _drafters(flat: dict):
    """All drafters of the run: per node times nodes (saved before nodes existed: one)."""
    m = flat.get("topology.num_drafters")
    return m * flat.get("topology.nodes", 1) if m is not None else None


def _per_step(flat: dict):
    ga, m = flat.get("train.grad_accum"), _drafters(flat)
    return ga * m if ga is not None and m is not None else None


def math_changes(saved: dict, current: dict) -> list[str]:
    """Config keys whose change would make a resumed run differ from an uninterrupted one."""
    a, b = _flatten(saved), _flatten(current)
    a[PER_STEP], b[PER_STEP] = _per_step(a), _per_step(b)
    # Where the feature cache lives is not math (memory and disk hold the same bits);
    # whether there is one is (a cached sample keeps its first batch's rounding).
    for d in (a, b):
        if CACHE_KEY in d:
            d[CACHE_KEY] = d[CACHE_KEY] != "off"
    keys = sorted(set(a) | set(b))
    return [k for k in keys if a.get(k) != b.get(k) and k not in PER_STEP_PARTS
            and (not k.startswith(RESUME_FREE) or k.startswith(NOT_FREE))]


def drafter_change(saved: dict, current: dict) -> str | None:
    """The one line a resume on another number of drafters prints (None: same number)."""
    a, b = _flatten(saved), _flatten(current)
    m0, m1 = _drafters(a), _drafters(b)
    if m0 == m1:
        return None
    return (f"resuming a run of {m0} drafter(s) on {m1}: train.grad_accum {a.get('train.grad_accum')} -> "
            f"{b.get('train.grad_accum')} keeps {_per_step(b)} batches per step and the data order; the "
            "gradients are summed in another order, so the result matches an uninterrupted run within "
            "float tolerance, not bit for bit")


def adapt_grad_accum(saved: dict, num_drafters: int) -> int | None:
    """The ``train.grad_accum`` that keeps a saved run's batches per step on
    ``num_drafters`` drafters in all (None: the same count as saved, nothing to adapt);
    ValueError if that many drafters cannot split a step evenly."""
    a = _flatten(saved)
    per_step = _per_step(a)
    if per_step is None or _drafters(a) == num_drafters:
        return None
    if per_step % num_drafters:
        raise ResumeError(f"topology: the run's steps hold {per_step} batches each, which {num_drafters} drafters "
                          f"cannot share evenly; resume on a drafter count that divides {per_step}")
    return per_step // num_drafters


def check_resumable(saved_config: dict, current_config: dict) -> None:
    changed = math_changes(saved_config, current_config)
    if changed:
        a, b = _flatten(saved_config), _flatten(current_config)
        a[PER_STEP], b[PER_STEP] = _per_step(a), _per_step(b)
        shown = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in changed[:4])
        more = f" (+{len(changed) - 4} more)" if len(changed) > 4 else ""
        raise ResumeError(f"resume refused: the config changes the math ({shown}{more})")
