"""Two nodes on loopback, each a full 1-1 job with its own supervisor and actors, linked
over gloo on 127.0.0.1, train exactly what one machine with both drafters (1-2) trains:
bit for bit, every batch exactly once between them, with an actor killed on each (one
node per gradient durability). (The
``chaos`` suite kills a whole node: ``tests/fault/test_cluster_node_loss.py``.)"""

import json
import threading

from dflash_actors.cluster.node import NodeSpec
from dflash_actors.job.job import Job
from dflash_actors.job.reference import train_reference
from dflash_actors.train.checkpoint import list_checkpoints, load_trainer_state
from tests.support.pipeline import assert_same_weights, final_weights, free_port, losses, small_config


def run_nodes(cfgs, port: int, resume: bool = False) -> list:
    """Build and run one Job per node, each in its own thread (the nodes meet while
    being built, so they must be built side by side); the (job, result) of each."""
    out = [None] * len(cfgs)

    def go(k):
        try:
            job = Job(cfgs[k], resume=resume, progress=False, node=NodeSpec(len(cfgs), k, "127.0.0.1", port))
            out[k] = (job, job.run())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out[k] = (None, e)

    threads = [threading.Thread(target=go, args=(k,)) for k in range(len(cfgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "a node did not finish"
    return out


def test_two_nodes_train_what_one_machine_with_both_drafters_trains(cache_dir, tmp_path):
    # Two batches per drafter per step: each node's drafter accumulates, as a 1-2 run
    # with train.grad_accum=2 does. Node 0's optimizer dies halfway through publishing
    # a step it already exchanged: its replacement must take the same sum again, not
    # ask the link for another.
    # Node 1 keeps its drafter's running sum on the device (grad_durability step), and
    # its drafter dies on the second batch of a step: the step's first batch is made
    # again from the loader on. Node 0 stores the sum after every batch (batch). Either
    # way: bit-identical. (Restarts are what cost here; make chaos kills drafters
    # mid-step under both durabilities: tests/fault/test_step_durability.py.)
    faults = [[{"actor": "optimizer.0", "at_batch": 5, "kind": "sigkill", "at": "publish"}],
              [{"actor": "drafter.0", "at_batch": 7, "kind": "sigkill"}]]
    durability = ["batch", "step"]
    # First: it builds the dataset and tiny target the two nodes, threads of one
    # process, would otherwise race to build under the same temporary names.
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "1-2", "train.grad_accum=2"), progress=False)
    runs = [tmp_path / "node0", tmp_path / "node1"]
    cfgs = [small_config(cache_dir, runs[k], "1-1", "topology.nodes=2", "train.grad_accum=2",
                         "train.checkpoint_every=2", "runtime.collective_timeout_s=60",
                         f"runtime.grad_durability={durability[k]}", ("runtime.faults", faults[k]))
            for k in range(2)]
    (job0, r0), (job1, r1) = run_nodes(cfgs, free_port())
    assert not isinstance(r0, BaseException) and not isinstance(r1, BaseException), (r0, r1)
    assert (r0.exit_code, r1.exit_code) == (0, 0), (r0.reason, r1.reason)

    # exactly once, between them
    ids = [job0.schedule.global_id(b) for b in r0.committed] + [job1.schedule.global_id(b) for b in r1.committed]
    assert sorted(ids) == list(range(ref.steps * 4))
    assert (r0.summary["restarts"], r1.summary["restarts"]) == (1, 1)
    died = [[e for e in map(json.loads, (run / "events.log").read_text().splitlines()) if e["event"] == "died"]
            for run in runs]
    assert [(e["actor"], e.get("redone")) for e in died[0]] == [("optimizer.0", None)]
    assert [(e["actor"], e.get("redone")) for e in died[1]] == [("drafter.0", [6])]
    # bit-identical to one machine, on both nodes
    assert losses(runs[0]) == ref.losses == losses(runs[1])
    assert_same_weights(final_weights(runs[0]), ref.state_dict)
    assert r0.summary["cluster"]["digest"] == r1.summary["cluster"]["digest"]
    for r in (r0, r1):
        assert r.summary["cluster"]["replicas"] == f"identical at version {ref.steps} on all 2 nodes"
        assert r.summary["cluster"]["replica_checks"] >= 1 and r.summary["cluster"]["reduce_s_mean"] > 0
    # node 0 alone writes checkpoints, and counts every node's batches
    assert not list_checkpoints(runs[1])
    state = load_trainer_state(list_checkpoints(runs[0])[-1])
    assert state["batches_applied"] == ref.steps * 4 == state["next_batch"]
    assert json.loads((runs[1] / "summary.json").read_text())["checkpoint"] is None
    # status.json: which node, and every step exchanged
    for k, run in enumerate(runs):
        c = json.loads((run / "status.json").read_text())["cluster"]
        assert (c["rank"], c["nodes"], c["steps_exchanged"], c["failure"]) == (k, 2, ref.steps, None)
