"""Files from elsewhere run no code, through the doors a user opens: a run directory whose
newest ``trainer_state.pt`` was replaced by a pickle that writes a file when unpickled,
its manifest rewritten to match, stops ``launch.py --resume`` and ``launch.py evaluate``
with exit 2 and one line naming the file (no falling back to the checkpoint before
it); a ``drafter.init_from`` whose weights file is such a pickle stops a launch the same
way. The file is never written. The same run directory, honest, resumes."""

import hashlib
import json
import os
import shlex

import pytest
import torch

import launch
from dflash_actors.config import dump_config, load_config
from dflash_actors.job.job import load_start
from dflash_actors.models.drafter_start import build_drafter
from dflash_actors.models.head import load_head
from dflash_actors.train.checkpoint import MANIFEST, STATE_FILE, checkpoint_root, save_checkpoint
from tests.support.pipeline import ROOT, SMALL

pytestmark = pytest.mark.timeout(180)


class Payload:
    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.sentinel))}",)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random target over the synthetic data's 256 ids: nothing waits for a fit."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    out = tmp_path_factory.mktemp("foreign") / "target"
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)).save_pretrained(out)
    return out


def overrides(cache_dir, target, *extra):
    return SMALL + [f"data.cache_dir={cache_dir}", f"target.path={target}", *extra]


@pytest.fixture
def run_dir(target, cache_dir, tmp_path):
    """A run directory as a job leaves it at step 2: config.yaml and checkpoints 1 and 2."""
    run_dir = tmp_path / "run"
    cfg = load_config(ROOT / "configs/default.yaml", overrides(cache_dir, target, f"runtime.run_dir={run_dir}"))
    drafter = build_drafter(cfg, load_head(cfg))
    for step in (1, 2):
        save_checkpoint(run_dir, step, drafter.save_pretrained, {"step": step, "config": cfg.to_dict(),
                                                                   "optimizer": None})
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return run_dir


def plant(run_dir, sentinel):
    """Step 2's trainer state becomes the planted pickle; its manifest is made to match."""
    ckpt = checkpoint_root(run_dir) / "step-0000002"
    path = ckpt / STATE_FILE
    state = torch.load(path, weights_only=True)
    torch.save({**state, "extra": Payload(sentinel)}, path)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    data = path.read_bytes()
    manifest["files"][STATE_FILE] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    return path


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def files(root) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_resume_refuses_a_planted_checkpoint(run_dir, tmp_path, capsys):
    sentinel = tmp_path / "ran"
    path = plant(run_dir, sentinel)
    before = files(run_dir)
    assert launch.main(["--resume", str(run_dir)]) == 2
    line = one_error_line(capsys)
    assert f"{path}: refused" in line and "posix.system" in line, line
    assert not sentinel.exists()
    after = files(run_dir)
    after.pop(".lock", None)        # the one file a refused job may leave (test_bad_inputs)
    assert after == before


def test_evaluate_refuses_a_planted_checkpoint(run_dir, tmp_path, capsys):
    sentinel = tmp_path / "ran"
    path = plant(run_dir, sentinel)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert launch.main(["evaluate", str(run_dir), "--prompts", str(prompts)]) == 2
    line = one_error_line(capsys)
    assert f"{path}: refused" in line, line
    assert not sentinel.exists()


def test_init_from_refuses_a_pickle_for_weights(run_dir, target, cache_dir, tmp_path, capsys):
    sentinel = tmp_path / "ran"
    drafter = checkpoint_root(run_dir) / "step-0000001"
    torch.save({"w": torch.zeros(2), "extra": Payload(sentinel)}, drafter / "model.safetensors")
    argv = [a for kv in overrides(cache_dir, target, f"drafter.init_from={drafter}") for a in ("--set", kv)]
    assert launch.main(argv + ["--run-dir", str(tmp_path / "new")]) == 2
    line = one_error_line(capsys)
    assert "drafter.init_from" in line and "not readable as safetensors" in line, line
    assert not sentinel.exists()


def test_the_honest_run_directory_resumes(run_dir, target, cache_dir):
    """The same directory without the plant: the resume's load takes step 2."""
    cfg = load_config(run_dir / "config.yaml")
    start = load_start(cfg, build_drafter(cfg, load_head(cfg)), run_dir, resume=True)
    assert start.version == 2 and start.checkpoint == checkpoint_root(run_dir) / "step-0000002"
