"""Shared helpers for the pipeline tests: one small config, reference results cached."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from pathlib import Path

import torch

from dflash_actors.config import load_config
from dflash_actors.job.job import Job
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.train.checkpoint import latest_checkpoint

from . import shared_server

ROOT = Path(__file__).resolve().parents[2]

# Small enough for CI, big enough for several steps per epoch and an epoch boundary.
SMALL = ["data.synthetic.num_samples=128", "data.synthetic.heldout_samples=4", "train.epochs=2",
         "runtime.heartbeat_s=0.2", "runtime.hang_timeout_s=60", "runtime.grace_s=5"]


# The tiny target as it was before its heads grew to 32 (the demo's default, servable):
# heads of 16, hidden 64. Tests whose thresholds were fitted on that model's text (a
# drafter fitted for 20 steps, a chat target that emits special tokens) keep it.
HEADS_16 = ["target.tiny.hidden_size=64", "target.tiny.intermediate_size=128"]


def small_config(cache_dir: Path, run_dir: Path, topology: str, *extra):
    """The small test config; ``extra``: ``--set`` text or ``(key, value)`` pairs."""
    return load_config(ROOT / "configs/default.yaml",
                       SMALL + [f"data.cache_dir={cache_dir}", f"runtime.run_dir={run_dir}", *extra],
                       topology=topology)


def new_job(cfg, **kw) -> Job:
    """``Job(cfg, **kw)`` whose actors fork from the session's shared fork server
    (``shared_server``), as launch.py's job forks from the one it started early."""
    return Job(cfg, forkserver=shared_server.get(), **kw)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return DFlashDrafter.from_pretrained(latest_checkpoint(run_dir)).state_dict()


def losses(run_dir: Path) -> list[float]:
    return json.loads((Path(run_dir) / "losses.json").read_text())


def assert_same_weights(got: dict, want: dict) -> None:
    keys = [k for k in want if not k.startswith("rotary_emb.")]
    assert keys and set(keys) <= set(got)
    differ = [k for k in keys if not torch.equal(got[k], want[k])]
    assert not differ, f"{len(differ)} tensors differ from the reference, e.g. {differ[:3]}"


def free_port() -> int:
    """A loopback port free right now (for a test's cluster rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_until_stopped(job, steps: int):
    """``job.run()`` in this process, stopped by SIGTERM (the supervisor's handler:
    checkpoint, then stop) once ``steps`` optimizer steps are done; its result."""
    over = threading.Event()

    def stop():
        while int(job.shared.step_stats[:, -1].sum()) < steps:
            if over.wait(0.02):
                return      # the job ended first: a SIGTERM now would hit pytest itself
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop, daemon=True).start()
    try:
        return job.run()
    finally:
        over.set()
