import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from dflash_actors.config import Config, load_config
from dflash_actors.train.checkpoint import (
    PER_STEP,
    ResumeError,
    adapt_grad_accum,
    check_resumable,
    drafter_change,
    latest_checkpoint,
    list_checkpoints,
    load_trainer_state,
    math_changes,
    remove_partial,
    save_checkpoint,
)


def write_weights(value):
    def write(d):
        torch.save({"w": torch.full((4,), float(value))}, d / "model.pt")
    return write


def test_save_list_latest(tmp_path):
    for step in (3, 10, 7):
        save_checkpoint(tmp_path, step, write_weights(step), {"step": step})
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step-0000003", "step-0000007", "step-0000010"]
    latest = latest_checkpoint(tmp_path)
    assert load_trainer_state(latest)["step"] == 10
    assert torch.load(latest / "model.pt")["w"][0] == 10
    save_checkpoint(tmp_path, 10, write_weights(99), {"step": 10, "again": True})   # same step: replaced
    assert load_trainer_state(latest_checkpoint(tmp_path))["again"]


def _slow_save(run_dir):
    def slow(d):
        (d / "part").write_text("half")
        time.sleep(60)
    save_checkpoint(run_dir, 20, slow, {"step": 20})


def test_kill_during_write_keeps_previous(tmp_path):
    save_checkpoint(tmp_path, 5, write_weights(5), {"step": 5})
    p = mp.get_context("spawn").Process(target=_slow_save, args=(str(tmp_path),))
    p.start()
    deadline = time.time() + 30
    while not list((tmp_path / "checkpoints").glob(".tmp-*/part")):
        assert time.time() < deadline and p.is_alive()
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert latest_checkpoint(tmp_path).name == "step-0000005"
    assert load_trainer_state(latest_checkpoint(tmp_path))["step"] == 5
    assert len(remove_partial(tmp_path)) == 1
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_math_changes_are_named():
    a = Config().to_dict()
    b = load_config(None, ["train.lr=1e-2", "runtime.hang_timeout_s=5", "topology.num_targets=3",
                           "topology.num_drafters=2"]).to_dict()
    assert math_changes(a, b) == [PER_STEP, "train.lr"]
    with pytest.raises(ResumeError, match=r"topology\.nodes\): 1 -> 2, train\.lr: 0\.0006 -> 0\.01"):
        check_resumable(a, b)
    # Drafters traded for accumulation keep each step's batches: allowed, and said.
    same = load_config(None, ["topology.num_drafters=2", "train.grad_accum=2"]).to_dict()
    four = load_config(None, ["train.grad_accum=4"]).to_dict()
    assert math_changes(same, four) == [] and drafter_change(same, four) is not None
    assert drafter_change(four, four) is None
    assert adapt_grad_accum(same, 1) == 4 and adapt_grad_accum(same, 4) == 1 and adapt_grad_accum(same, 2) is None
    with pytest.raises(ResumeError, match="3 drafters cannot share evenly"):
        adapt_grad_accum(same, 3)
    check_resumable(a, load_config(None, ["runtime.run_dir=elsewhere", "train.checkpoint_every=3",
                                          "runtime.schedule=lockstep", "runtime.trace=true"]).to_dict())
    # Simulated compute fakes the gradients: a real run cannot continue as a simulated one.
    sim = load_config(None, ["runtime.simulate.enabled=true"]).to_dict()
    assert math_changes(a, sim) == ["runtime.simulate.enabled"]


def test_the_feature_cache_may_move_but_not_come_or_go():
    """memory and disk hold the same bits; a cache on or off changes them (a cached
    sample keeps its first batch's rounding)."""
    mem, disk, off = (load_config(None, [f"target.feature_cache={v}"]).to_dict() for v in ("memory", "disk", "off"))
    assert math_changes(mem, disk) == []
    assert math_changes(off, mem) == math_changes(disk, off) == ["target.feature_cache"]
