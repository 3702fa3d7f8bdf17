"""A checkpoint runs no code when loaded: a ``trainer_state.pt`` replaced by a pickle
whose payload writes a file, its manifest rewritten to match, is refused as foreign
(not passed over as damage), in each format ``torch.load`` reads, and the file is never
written; what the trainer writes names only ``STATE_GLOBALS``; and no loader in the
package unpickles a file or trusts a model's code."""

import ast
import hashlib
import json
import os
import pickle
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_actors.config import load_config
from dflash_actors.train.checkpoint import (
    MANIFEST,
    STATE_FILE,
    STATE_GLOBALS,
    CheckpointError,
    ForeignFileError,
    checkpoint_problem,
    checkpoint_root,
    foreign_globals,
    load_trainer_state,
    newest_usable,
    save_checkpoint,
    trainer_state,
)

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


class Payload:
    """Unpickled, runs ``touch SENTINEL``: what a planted checkpoint would do."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.sentinel))}",)


def honest_state(step: int) -> dict:
    return {"step": step, "optimizer": {"exp_avg": torch.full((8,), 0.5)}, "config": {"train": {"lr": 0.01}}}


def write_drafter(d: Path) -> None:
    (d / "config.json").write_text("{}")


PLANTS = {
    # torch.save's own format (a zip whose data.pkl is pickled at protocol 2: GLOBAL)
    "torch.save zip": lambda path, payload: torch.save({**honest_state(4), "x": payload}, path),
    # torch's format before zips: five pickles in a row, then raw storages
    "torch legacy": lambda path, payload: torch.save({**honest_state(4), "x": payload}, path,
                                                     _use_new_zipfile_serialization=False),
    # the repro: a bare pickle (protocol 5: STACK_GLOBAL)
    "bare pickle": lambda path, payload: path.write_bytes(pickle.dumps(payload, protocol=5)),
}


def plant(ckpt: Path, how: str, sentinel: Path) -> Path:
    """Replace ``ckpt``'s trainer state by a planted one and rewrite the manifest to match:
    what someone who can write the run directory can do."""
    path = ckpt / STATE_FILE
    PLANTS[how](path, Payload(sentinel))
    manifest = json.loads((ckpt / MANIFEST).read_text())
    data = path.read_bytes()
    manifest["files"][STATE_FILE] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    assert checkpoint_problem(ckpt) is None, "the plant must pass its manifest"
    return path


@pytest.mark.parametrize("how", PLANTS)
def test_the_plant_runs_its_payload_when_unpickled(tmp_path, how):
    """The control: without the guard, each plant writes its file."""
    sentinel = tmp_path / "ran"
    path = tmp_path / STATE_FILE
    PLANTS[how](path, Payload(sentinel))
    try:
        if how == "bare pickle":
            pickle.loads(path.read_bytes())
        else:
            torch.load(path, weights_only=False)
    except Exception:  # noqa: BLE001 - the legacy reader chokes after the payload ran
        pass
    assert sentinel.exists()


@pytest.mark.parametrize("how", PLANTS)
def test_a_planted_trainer_state_is_refused_and_runs_nothing(tmp_path, how):
    for step in (2, 4):
        save_checkpoint(tmp_path, step, write_drafter, honest_state(step))
    sentinel = tmp_path / "ran"
    path = plant(checkpoint_root(tmp_path) / "step-0000004", how, sentinel)
    with pytest.raises(ForeignFileError) as refused:
        load_trainer_state(path.parent)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{path}: refused") and "posix.system" in line, line
    # Foreign is not damage: no falling back to step 2 around it.
    with pytest.raises(ForeignFileError):
        newest_usable(tmp_path, load_trainer_state)
    assert not sentinel.exists()


def test_refused_without_a_manifest_too(tmp_path):
    """A checkpoint from before manifests is loaded unchecked: the guard is in the load."""
    save_checkpoint(tmp_path, 2, write_drafter, honest_state(2))
    ckpt = checkpoint_root(tmp_path) / "step-0000002"
    plant(ckpt, "torch.save zip", tmp_path / "ran")
    (ckpt / MANIFEST).unlink()
    with pytest.raises(ForeignFileError):
        newest_usable(tmp_path, load_trainer_state)
    assert not (tmp_path / "ran").exists()


def test_an_unlisted_global_is_refused_even_where_torch_would_build_it(tmp_path):
    """The allow-list is what a trainer state holds, narrower than torch's own: an int64
    tensor (``torch.LongStorage``) is harmless to torch, but no trainer state has one."""
    save_checkpoint(tmp_path, 2, write_drafter, {**honest_state(2), "ids": torch.arange(3)})
    with pytest.raises(ForeignFileError, match="torch.LongStorage"):
        load_trainer_state(checkpoint_root(tmp_path) / "step-0000002")


def test_damage_is_still_damage(tmp_path):
    """A truncated pickle names nothing foreign before it stops: a CheckpointError, which
    a resume passes over to the previous checkpoint."""
    for step in (2, 4):
        save_checkpoint(tmp_path, step, write_drafter, honest_state(step))
    root = checkpoint_root(tmp_path)
    path = root / "step-0000004" / STATE_FILE
    torch.save(honest_state(4), path, _use_new_zipfile_serialization=False)
    path.write_bytes(path.read_bytes()[:40])
    (root / "step-0000004" / MANIFEST).unlink()
    (root / "step-0000002" / MANIFEST).unlink()
    with pytest.raises(CheckpointError):
        load_trainer_state(path.parent)
    found = newest_usable(tmp_path, load_trainer_state)
    assert found.path == root / "step-0000002" and found.loaded["step"] == 2


def test_the_trainer_state_names_exactly_the_allowed_globals(tmp_path):
    """What ``trainer_state`` writes (real config, moments from a store) needs every
    allowed global and no other, and loads back equal."""
    cfg = load_config(ROOT / "configs" / "default.yaml")
    moments = torch.linspace(0, 1, 12), torch.linspace(1, 2, 12)
    store = SimpleNamespace(moments_flat=lambda v: moments, applied=lambda v: 3 * v,
                            layout=SimpleNamespace(names=("fc.weight", "norm.weight")))
    schedule = SimpleNamespace(epoch_of_step=lambda v: 0, batches_per_step=3, total_steps=100)
    state = trainer_state(cfg, schedule, store, 7)
    ckpt = save_checkpoint(tmp_path, 7, write_drafter, state)
    assert foreign_globals(ckpt / STATE_FILE, frozenset()) == sorted(STATE_GLOBALS)
    assert foreign_globals(ckpt / STATE_FILE) == []
    loaded = load_trainer_state(ckpt)
    assert loaded["config"] == cfg.to_dict() and loaded["config_hash"] == cfg.digest()
    assert torch.equal(loaded["optimizer"]["exp_avg_sq"], moments[1])


# --- every other loader: none unpickles a file, none trusts a model's code ------------

UNSAFE_KEYWORDS = {"weights_only": False, "allow_pickle": True, "trust_remote_code": True}
UNPICKLERS = {"pickle.load", "pickle.loads", "pickle.Unpickler", "torch.jit.load", "dill.load", "dill.loads",
              "cloudpickle.load", "cloudpickle.loads", "joblib.load"}
IN_MEMORY = {("dflash_actors/runtime/boot.py", "pickle.loads")}
"""Unpickling that reads no file: a child's spawn arguments, from its own parent."""


def _dotted(node) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def unsafe_loads(source: str, rel: str) -> list[str]:
    """Each call in ``source`` (the file ``rel``) that could run a file's code, as ``rel:line what``."""
    found = []
    for node in ast.walk(ast.parse(source, rel)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        kw = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}
        where = f"{rel}:{node.lineno}"
        if name in UNPICKLERS and (rel, name) not in IN_MEMORY:
            found.append(f"{where} {name}")
        if name == "torch.load" and kw.get("weights_only") is not True:
            found.append(f"{where} torch.load without weights_only=True")
        found += [f"{where} {k}={v}" for k, v in UNSAFE_KEYWORDS.items() if k in kw and kw[k] is v]
    return found


def test_the_scan_finds_what_it_looks_for():
    bad = ("pickle.load(f)\ntorch.load(p)\ntorch.load(p, weights_only=True)\nnp.load(p, allow_pickle=True)\n"
           "AutoModel.from_pretrained(p, trust_remote_code=True)\npickle.loads(b)\n")
    assert unsafe_loads(bad, "x.py") == ["x.py:1 pickle.load", "x.py:2 torch.load without weights_only=True",
                                         "x.py:4 allow_pickle=True", "x.py:5 trust_remote_code=True",
                                         "x.py:6 pickle.loads"]
    assert [f.split()[-1] for f in unsafe_loads(bad, "dflash_actors/runtime/boot.py")][-1] != "pickle.loads"


def test_no_loader_in_the_package_runs_code_from_a_file():
    files = [ROOT / "launch.py", *sorted((ROOT / "dflash_actors").rglob("*.py"))]
    assert [f for p in files for f in unsafe_loads(p.read_text(), p.relative_to(ROOT).as_posix())] == []
