"""Checkpoints: ``<run_dir>/checkpoints/step-NNNNNNN/`` written atomically.

Each holds the HF drafter directory (config.json + model.safetensors, loadable by
z-lab's DFlashDraftModel) and ``trainer_state.pt`` (optimizer, scheduler, step, epoch,
next batch id, RNG, config). A checkpoint is built under a hidden temporary name and
renamed into place after every file is fsynced, so a directory named ``step-*`` is
complete by construction; a write killed halfway leaves only a ``.tmp-*`` that the next
save or resume removes, and the previous checkpoint still loads.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable

import torch

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step-(\d{7,})$")

# Keys that may change between a run and its resume without changing the math.
RESUME_FREE = ("runtime.", "topology.num_targets", "topology.target_devices",
               "topology.drafter_devices", "train.checkpoint_every", "data.cache_dir", "target.self_check",
               "eval.")
NOT_FREE = ("runtime.simulate.",)
"""Exceptions to RESUME_FREE: simulated gradients are not the real ones."""


class ResumeError(ValueError):
    """A resume that would not continue the same training; the message says why."""


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | Path, step: int, write_drafter: Callable[[Path], None],
                    trainer_state: dict) -> Path:
    """Write ``step-NNNNNNN`` atomically; ``write_drafter(dir)`` saves the HF directory."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:07d}"
    tmp = root / f".tmp-step-{step:07d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_drafter(tmp)
    torch.save(trainer_state, tmp / STATE_FILE)
    _fsync_tree(tmp)
    if final.exists():          # same step saved again (e.g. final == periodic): replace
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def remove_partial(run_dir: str | Path) -> list[Path]:
    """Delete ``.tmp-*`` leftovers of writes that were killed; return what was removed."""
    root = checkpoint_root(run_dir)
    gone = [p for p in root.glob(".tmp-step-*")] if root.is_dir() else []
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_trainer_state(ckpt: Path) -> dict:
    return torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)


def trainer_state(cfg, schedule, store, version: int) -> dict:
    """What ``trainer_state.pt`` holds for weight version ``version`` (= optimizer steps).

    No RNG state is saved because none is carried: every random choice is derived from
    ``(train.seed, epoch, batch id, row)``, so the next batch id is all a resume needs.
    """
    exp_avg, exp_avg_sq = (t.clone() for t in store.moments_flat(version))
    return {
        "step": version, "epoch": schedule.epoch_of_step(version), "next_batch": schedule.first_of_step(version),
        "total_steps": schedule.total_steps,
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


def math_changes(saved: dict, current: dict) -> list[str]:
    """Config keys whose change would make a resumed run differ from an uninterrupted one."""
    a, b = _flatten(saved), _flatten(current)
    keys = sorted(set(a) | set(b))
    return [k for k in keys if a.get(k) != b.get(k) and (not k.startswith(RESUME_FREE) or k.startswith(NOT_FREE))]


def check_resumable(saved_config: dict, current_config: dict) -> None:
    changed = math_changes(saved_config, current_config)
    if changed:
        shown = ", ".join(f"{k}: {_flatten(saved_config).get(k)!r} -> {_flatten(current_config).get(k)!r}"
                          for k in changed[:4])
        more = f" (+{len(changed) - 4} more)" if len(changed) > 4 else ""
        raise ResumeError(f"resume refused: the config changes the math ({shown}{more})")
