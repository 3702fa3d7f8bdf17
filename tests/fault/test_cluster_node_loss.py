"""kill -9 of one node's supervisor, two nodes on loopback launched as a user launches
them: the other node stops within ``runtime.collective_timeout_s`` with exit 1 and a
line naming the lost node, nothing of either outlives it, and ``--resume`` on both
finishes the run bit-identical to one machine with both drafters."""

import json
import subprocess
import sys
import time

import psutil
import pytest

from dflash_actors.job.reference import train_reference
from tests.support.pipeline import ROOT, SMALL, assert_same_weights, final_weights, free_port, losses, small_config
from tests.support.runtime import all_gone

TIMEOUT_S = 10
ARGS = [*SMALL, "train.epochs=8", "train.checkpoint_every=2", f"runtime.collective_timeout_s={TIMEOUT_S}"]


def launch(run_dir, rank: int, port: int, cache_dir, resume: bool = False) -> subprocess.Popen:
    where = ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir), "--topology", "1-1"]
    sets = [] if resume else [x for a in [*ARGS, f"data.cache_dir={cache_dir}"] for x in ("--set", a)]
    return subprocess.Popen([sys.executable, "launch.py", *where, *sets, "--nnodes", "2", "--node-rank", str(rank),
                             "--master", f"127.0.0.1:{port}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def status(path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@pytest.mark.chaos
@pytest.mark.timeout(600)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_lost_node_stops_the_other_and_both_resume(cache_dir, tmp_path, victim):
    run_dir = tmp_path / "run"
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "1-2", *ARGS[len(SMALL):]), progress=False)
    port = free_port()
    procs = [launch(run_dir, k, port, cache_dir) for k in (0, 1)]
    dirs = [run_dir, run_dir / "node-1"]
    try:
        end = time.monotonic() + 240
        while time.monotonic() < end:
            st = status(dirs[victim] / "status.json")
            if st and (st.get("training") or {}).get("step", 0) >= 6:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the nodes never reached step 6")
        sup = psutil.Process(st["supervisor_pid"])
        actors = [c.pid for c in sup.children(recursive=True)]
        sup.kill()
        t_kill = time.monotonic()
        survivor = procs[1 - victim]
        out, err = survivor.communicate(timeout=TIMEOUT_S + 60)
        waited = time.monotonic() - t_kill
        assert survivor.returncode == 1, err[-2000:]
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert lines and f"lost node {victim}" in lines[-1], err[-2000:]
        # Detection within the timeout (plus one beat); then the actors stop and node 0
        # writes its final checkpoint.
        assert waited < TIMEOUT_S + 30, waited
        procs[victim].wait(10)
        assert all_gone(actors, within_s=5), "an actor of the killed node outlived it"
    finally:
        for p in procs:
            p.kill()
            p.wait()
    port = free_port()
    again = [launch(run_dir, k, port, cache_dir, resume=True) for k in (0, 1)]
    try:
        for p in again:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-2000:]
    finally:
        for p in again:
            p.kill()
    summaries = [json.loads((d / "summary.json").read_text()) for d in dirs]
    assert all(s["result"] == "finished" and s["step"] == ref.steps for s in summaries)
    assert summaries[0]["cluster"]["digest"] == summaries[1]["cluster"]["digest"]
    assert summaries[0]["cluster"]["replicas"].startswith("identical")
    assert_same_weights(final_weights(run_dir), ref.state_dict)
    resumed = losses(run_dir)
    assert resumed and resumed == ref.losses[-len(resumed):]


@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_torchrun_max_restarts_relaunches_both_nodes_which_resume(cache_dir, tmp_path):
    """Under ``torchrun --max-restarts 1``: kill -9 of node 1's launch.py; node 0's stops
    on the lost node, torchrun relaunches both with the first command line, each sees
    it is a relaunch and resumes, and the run ends as one machine's would."""
    run_dir, port = tmp_path / "run", free_port()
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "1-2", *ARGS[len(SMALL):]), progress=False)
    sets = [x for a in [*ARGS, f"data.cache_dir={cache_dir}"] for x in ("--set", a)]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--max-restarts", "1", "--node-rank", str(k), "--master-addr", "127.0.0.1",
                               "--master-port", str(port), "launch.py", "--topology", "1-1", "--run-dir",
                               str(run_dir), *sets], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for k in (0, 1)]
    try:
        end = time.monotonic() + 240
        while time.monotonic() < end:
            st = status(run_dir / "node-1" / "status.json")
            if st and (st.get("training") or {}).get("step", 0) >= 6:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the nodes never reached step 6")
        psutil.Process(st["supervisor_pid"]).kill()
        errs = [p.communicate(timeout=400)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [e[-1500:] for e in errs]
    assert "error: lost node 1" in errs[0]
    for k, e in enumerate(errs):
        assert f"relaunch 1 of this job: resuming {run_dir / 'node-1' if k else run_dir}" in e
    assert json.loads((run_dir / "summary.json").read_text())["cluster"]["replicas"].startswith("identical")
    assert_same_weights(final_weights(run_dir), ref.state_dict)
