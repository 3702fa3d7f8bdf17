"""Checkpoint integrity: manifests, verification, fallback past damage, full disks."""

import contextlib
import errno
import hashlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_actors.actors.optimizer import Optimizer
from dflash_actors.train.checkpoint import (
    MANIFEST,
    STATE_FILE,
    checkpoint_problem,
    checkpoint_root,
    has_manifest,
    latest_checkpoint,
    load_trainer_state,
    newest_usable,
    save_checkpoint,
    verified_checkpoint,
)

WEIGHTS = "model.safetensors"
FILL = 0.5      # every tensor value: its float32 bytes are easy to find in a file


def write_drafter(value):
    """A drafter-shaped directory: config.json + model.safetensors."""
    def write(d):
        (d / "config.json").write_text(json.dumps({"value": value, "block_size": 8}))
        save_file({"w": torch.full((256,), FILL), "b": torch.full((64,), float(value))}, str(d / WEIGHTS))
    return write


def state(step):
    return {"step": step, "optimizer": {"exp_avg": torch.full((256,), FILL)}}


def run_with(tmp_path, *steps):
    for s in steps:
        save_checkpoint(tmp_path, s, write_drafter(s), state(s))
    return checkpoint_root(tmp_path)


def flip_tensor_byte(path):
    """Change one float of the FILL tensor in place (0.5 -> 0.125): the file still loads."""
    raw = bytearray(path.read_bytes())
    at = raw.find(torch.tensor([FILL] * 16).numpy().tobytes())
    assert at >= 0
    raw[at + 4 * 5 + 3] ^= 0x01
    path.write_bytes(bytes(raw))


def test_manifest_holds_size_and_sha256_of_every_other_file(tmp_path):
    ckpt = run_with(tmp_path, 2) / "step-0000002"
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert sorted(files) == sorted(p.name for p in ckpt.iterdir() if p.name != MANIFEST)
    for name, entry in files.items():
        data = (ckpt / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert checkpoint_problem(ckpt) is None and verified_checkpoint(tmp_path, 2) == ckpt


def test_flipped_tensor_bytes_load_silently(tmp_path):
    """Why checksums: a flipped byte in tensor data loads without a word."""
    ckpt = run_with(tmp_path, 2) / "step-0000002"
    flip_tensor_byte(ckpt / WEIGHTS)
    flip_tensor_byte(ckpt / STATE_FILE)
    assert load_file(str(ckpt / WEIGHTS))["w"][5] != FILL
    assert load_trainer_state(ckpt)["optimizer"]["exp_avg"][5] != FILL


def _truncate(p):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _same_size_garbage(p):
    p.write_bytes(b"x" * p.stat().st_size)


def _break_safetensors_header(p):
    raw = bytearray(p.read_bytes())
    raw[8:24] = b"{{{{{{{{{{{{{{{{"
    p.write_bytes(bytes(raw))


DAMAGE = {
    "flipped byte in model.safetensors data": (WEIGHTS, flip_tensor_byte, f"{WEIGHTS} does not match its checksum"),
    "flipped byte in trainer_state.pt data": (STATE_FILE, flip_tensor_byte, "trainer_state.pt does not match its"),
    "truncated model.safetensors": (WEIGHTS, _truncate, "model.safetensors has "),
    "empty trainer_state.pt": (STATE_FILE, lambda p: p.write_bytes(b""), "trainer_state.pt has 0 bytes"),
    "corrupt safetensors header": (WEIGHTS, _break_safetensors_header, "model.safetensors does not match its checksum"),
    "garbage config.json": ("config.json", _same_size_garbage, "config.json does not match its checksum"),
    "deleted config.json": ("config.json", lambda p: p.unlink(), "config.json is missing"),
    "garbage manifest": (MANIFEST, _same_size_garbage, "manifest.json is unreadable"),
    "manifest reaching outside": (MANIFEST, lambda p: p.write_text(json.dumps(
        {"files": {STATE_FILE: {"bytes": 1, "sha256": "0"}, "../x": {"bytes": 1, "sha256": "0"}}})),
        "names a file outside the checkpoint"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_damage_is_named_and_the_previous_checkpoint_used(tmp_path, case):
    name, damage, expected = DAMAGE[case]
    root = run_with(tmp_path, 2, 4, 6)
    damage(root / "step-0000006" / name)
    why = checkpoint_problem(root / "step-0000006")
    assert why is not None and expected in why, why
    assert latest_checkpoint(tmp_path) == root / "step-0000004"
    assert verified_checkpoint(tmp_path, 6) is None and verified_checkpoint(tmp_path, 4) is not None
    found = newest_usable(tmp_path, load_trainer_state)
    assert found.path == root / "step-0000004" and found.loaded["step"] == 4
    assert found.skipped == [(root / "step-0000006", why)]


def test_nothing_usable_reports_every_checkpoint(tmp_path):
    root = run_with(tmp_path, 2, 4)
    _truncate(root / "step-0000002" / WEIGHTS)
    flip_tensor_byte(root / "step-0000004" / STATE_FILE)
    found = newest_usable(tmp_path, load_trainer_state)
    assert found.path is None and latest_checkpoint(tmp_path) is None
    assert [(p.name, why.split()[0]) for p, why in found.skipped] == [
        ("step-0000004", STATE_FILE), ("step-0000002", WEIGHTS)]


def test_garbage_in_a_newer_step_dir_is_passed_over(tmp_path):
    root = run_with(tmp_path, 2, 4)
    junk = root / "step-0000009"
    junk.mkdir()
    (junk / STATE_FILE).write_bytes(os.urandom(300))
    (junk / WEIGHTS).write_bytes(os.urandom(300))
    # Newer than a checkpoint with a manifest, it cannot be from before manifests.
    assert checkpoint_problem(junk, unchecked_ok=False) == "manifest.json is missing"
    assert latest_checkpoint(tmp_path) == root / "step-0000004"
    found = newest_usable(tmp_path, load_trainer_state)
    assert found.path == root / "step-0000004" and found.skipped == [(junk, "manifest.json is missing")]


def test_checkpoints_from_before_manifests_are_accepted_and_still_judged_by_loading(tmp_path):
    root = run_with(tmp_path, 2, 4)
    for s in (2, 4):
        (root / f"step-{s:07d}" / MANIFEST).unlink()
    assert latest_checkpoint(tmp_path) == root / "step-0000004" and not has_manifest(root / "step-0000004")
    _same_size_garbage(root / "step-0000004" / STATE_FILE)       # nothing to check it against
    found = newest_usable(tmp_path, load_trainer_state)
    assert found.path == root / "step-0000002"
    [(skipped, why)] = found.skipped
    assert skipped.name == "step-0000004" and f"{STATE_FILE}: cannot be loaded" in why


def _full_disk(*_, **__):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _drafter_then_full(d):
    write_drafter(9)(d)
    _full_disk()


@pytest.mark.parametrize("where", ["drafter files", "trainer state"])
def test_full_disk_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where):
    root = run_with(tmp_path, 4)
    writer = _drafter_then_full
    if where == "trainer state":
        writer = write_drafter(8)
        monkeypatch.setattr(torch, "save", _full_disk)
    with pytest.raises(OSError) as raised:
        save_checkpoint(tmp_path, 8, writer, state(8))
    assert raised.value.errno == errno.ENOSPC
    assert sorted(p.name for p in root.iterdir()) == ["step-0000004"], "the temporary directory was left"
    assert latest_checkpoint(tmp_path) == root / "step-0000004" and checkpoint_problem(root / "step-0000004") is None


def test_a_save_removes_temporaries_of_dead_writers_only(tmp_path):
    root = run_with(tmp_path, 2)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = int(gone.stdout), os.getppid()
    for pid in (dead, alive):
        (root / f".tmp-step-0000004-{pid}").mkdir()
        (root / f".tmp-step-0000004-{pid}" / "part").write_text("half")
    save_checkpoint(tmp_path, 4, write_drafter(4), state(4))
    assert sorted(p.name for p in root.iterdir()) == [f".tmp-step-0000004-{alive}", "step-0000002", "step-0000004"]


class OptimizerStub:
    """What ``Optimizer._maybe_checkpoint`` touches of its actor."""

    def __init__(self, run_dir, writer):
        train = SimpleNamespace(checkpoint_every=2)
        runtime = SimpleNamespace(run_dir=str(run_dir), hang_timeout_s=10.0)
        self.spec = SimpleNamespace(cfg=SimpleNamespace(train=train, runtime=runtime),
                                    schedule=SimpleNamespace(total_steps=10, node=0),
                                    weights=SimpleNamespace(layout=SimpleNamespace(numel=100)))
        self.model = SimpleNamespace(save_pretrained=writer)
        self.reported = []

    def report(self, event, **fields):
        self.reported.append((event, fields))

    def _drafter_writer(self, version):
        return self.model.save_pretrained

    def beating(self, limit_s=None):
        return contextlib.nullcontext()

    def span(self, *_, **__):
        return contextlib.nullcontext()


@pytest.fixture
def optimizer_state(monkeypatch):
    monkeypatch.setattr("dflash_actors.actors.optimizer.trainer_state", lambda cfg, schedule, store, v: state(v))


def test_periodic_checkpoint_on_a_full_disk_is_skipped_and_retried(tmp_path, optimizer_state, capsys):
    root = run_with(tmp_path, 2)
    opt = OptimizerStub(tmp_path, _drafter_then_full)
    Optimizer._maybe_checkpoint(opt, 4)    # returns: no crash
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step-0000004 not written" in err[0] and "next try at step 6" in err[0], err
    assert [(e, f["step"]) for e, f in opt.reported] == [("checkpoint_failed", 4)]     # and in events.log
    assert sorted(p.name for p in root.iterdir()) == ["step-0000002"]
    Optimizer._maybe_checkpoint(OptimizerStub(tmp_path, write_drafter(6)), 6)
    assert latest_checkpoint(tmp_path) == root / "step-0000006"


def test_periodic_checkpoint_other_os_errors_still_crash(tmp_path, optimizer_state):
    def broken(d):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        Optimizer._maybe_checkpoint(OptimizerStub(tmp_path, broken), 4)


def test_periodic_checkpoint_rewrites_a_damaged_one_and_keeps_a_sound_one(tmp_path, optimizer_state):
    root = run_with(tmp_path, 2, 4)
    written = []

    def writer(d):
        written.append(d.name)
        write_drafter(4)(d)
    Optimizer._maybe_checkpoint(OptimizerStub(tmp_path, writer), 4)
    assert written == []
    flip_tensor_byte(root / "step-0000004" / WEIGHTS)
    Optimizer._maybe_checkpoint(OptimizerStub(tmp_path, writer), 4)
    assert len(written) == 1 and verified_checkpoint(tmp_path, 4) == root / "step-0000004"
