"""``train.optimizer: muon`` through the pipeline: a 2-2 job whose drafter.1 is killed
(-9), then stopped (SIGTERM: checkpoint, exit 130) and resumed with ``--resume``, ends
bit-identical to the reference. The optimizer publishes each Muon momentum buffer as
its ``exp_avg``; the checkpoint carries it (through the foreign-pickle guard) and the
resumed optimizer rebuilds it from there (``optim.MuonAdamW``). The drafter is a DFlash2,
so its codebooks ride on AdamW beside Muon's matrices, and AdamW alone would have
trained it otherwise."""

import launch
from dflash_actors.job.reference import train_reference
from dflash_actors.train.checkpoint import latest_checkpoint, load_trainer_state
from tests.support.pipeline import assert_same_weights, final_weights, losses, new_job, run_until_stopped, small_config

MUON = ("train.optimizer=muon", "drafter.arch=dflash2", "drafter.selector_rank=16",
        "train.checkpoint_every=2")


def test_muon_survives_a_kill_and_a_resume_bit_for_bit(cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    kill = ("runtime.faults", [{"actor": "drafter.1", "at_batch": 5, "kind": "sigkill"}])
    job = new_job(small_config(cache_dir, run_dir, "2-2", *MUON, kill), progress=False)
    first = run_until_stopped(job, 4)
    assert first.exit_code == 130, first.reason
    assert first.summary["restarts_by_actor"] == {"drafter.1": 1}
    assert 4 <= first.summary["step"] < job.schedule.total_steps
    state = load_trainer_state(latest_checkpoint(run_dir))
    assert state["config"]["train"]["optimizer"] == "muon" and state["optimizer"]["exp_avg"].any()
    assert launch.main(["--resume", str(run_dir)]) == 0

    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "2-2", *MUON), progress=False)
    assert_same_weights(final_weights(run_dir), ref.state_dict)
    assert losses(run_dir) == ref.losses[first.summary["step"]:]
    adamw = train_reference(small_config(cache_dir, tmp_path / "adamw", "2-2", *MUON[1:]), progress=False)
    assert adamw.losses[0] == ref.losses[0] and adamw.losses[1:] != ref.losses[1:]
