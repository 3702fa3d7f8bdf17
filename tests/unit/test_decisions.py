"""The supervisor's decisions (restart, give up, raise, hang) over a group with no
processes (``tests/support/memgroup.py``): its real dispatcher, ledger, health and
restart policies, in milliseconds. The same decisions on real processes, kills
included, are ``tests/fault`` and ``tests/integration/test_runtime.py``."""

from __future__ import annotations

import psutil
import pytest

from dflash_actors.runtime.actor import Escalate
from dflash_actors.runtime.ledger import Col
from dflash_actors.runtime.outcome import JobState
from tests.support.memgroup import MemoryGroup
from tests.support.runtime import events, runtime
from tests.support.toy import S, toy_job

N = 40


def job(tmp_path, n=N, **script):
    """Loader -> target -> two drafters (batch b to drafter b % 2), in memory."""
    rt = {k: script.pop(k) for k in ("max_restarts", "restart_window_s", "hang_timeout_s") if k in script}
    sup, _ = toy_job(runtime(tmp_path, **rt), n_batches=n, n_drafters=2, group=MemoryGroup.factory(**script))
    return sup


def restarts(sup, **nonzero):
    return {c.actor_id: nonzero.get(c.actor_id.replace(".", "_"), 0) for c in sup.children}


def assert_all_once(sup, result, n=N):
    assert sorted(result.committed) == list(range(n)), "a batch is missing or repeated"
    assert (sup.ledger.table[:, Col.STATE] == S.COMMITTED).all()
    assert (sup.ledger.table[:, Col.OWNER] == -1).all()
    assert all(r["used"] == 0 for r in sup.dispatcher.occupancy().values()), "a slot leaked"


def test_a_clean_job_commits_every_batch_once_and_starts_no_process(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    sup = job(tmp_path)
    result = sup.run()
    assert result.state is JobState.DONE and result.reason == "finished"
    assert_all_once(sup, result)
    assert result.restarts == restarts(sup)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    # Each stage took each batch once, and each drafter only its own, in increasing id.
    seen = sup.group.work_seen
    for role in ("loader", "target"):
        assert sorted(b for a, b in seen if a.startswith(role)) == list(range(N))
    for k in (0, 1):
        assert [b for a, b in seen if a == f"drafter.{k}"] == list(range(k, N, 2))


def test_a_killed_actor_is_restarted_alone_and_its_batch_done_again(tmp_path):
    sup = job(tmp_path, fates={("target.0", 7): "die"})
    result = sup.run()
    assert result.state is JobState.DONE, result.reason
    assert_all_once(sup, result)
    assert result.restarts == restarts(sup, target_0=1)
    died = events(tmp_path / "run", "died")
    assert [(d["actor"], d["reason"], d["decision"]) for d in died] == [("target.0", "killed by SIGKILL", "restart")]
    assert 7 in died[0]["put_back"]
    assert [b for a, b in sup.group.work_seen if a == "target.0"].count(7) == 2


def test_deaths_past_the_restart_intensity_give_up_with_one_line(tmp_path):
    sup = job(tmp_path, max_restarts=2, restart_window_s=300,
              fates={("drafter.1", 1): "die", ("drafter.1", 3): "die", ("drafter.1", 5): "die"})
    result = sup.run()
    assert result.state is JobState.FAILED
    assert result.reason == "drafter.1 died 3 times within 300s (max_restarts=2); last exit: killed by SIGKILL"
    assert result.restarts == restarts(sup, drafter_1=2)
    assert [e["actor"] for e in events(tmp_path / "run", "give_up")] == ["drafter.1"]
    assert sorted(result.committed) == sorted(set(result.committed)), "a batch committed twice"
    assert 5 not in result.committed


@pytest.mark.parametrize("failures, max_restarts", [(2, 2), (3, 2)])
def test_an_actor_that_fails_to_start_is_restarted_until_the_intensity(tmp_path, failures, max_restarts):
    sup = job(tmp_path, max_restarts=max_restarts, restart_window_s=300, start_failures={"loader.0": failures})
    result = sup.run()
    if failures <= max_restarts:
        assert result.state is JobState.DONE, result.reason
        assert_all_once(sup, result)
        assert result.restarts == restarts(sup, loader_0=failures)
    else:
        assert result.state is JobState.FAILED
        assert result.reason == (f"loader.0 died {failures} times within 300s (max_restarts={max_restarts}); "
                                 f"last exit: RuntimeError: cannot attach (told to)")
        assert result.committed == []
    assert len(events(tmp_path / "run", "actor_error")) == failures


def test_an_escalated_error_stops_the_job_and_reaches_the_caller(tmp_path):
    sup = job(tmp_path, fates={("drafter.0", 4): "raise"})
    result = sup.run()
    assert result.state is JobState.FAILED
    assert result.reason == "drafter.0: Escalate: batch 4 cannot be made (told to)"
    assert isinstance(result.raised, Escalate)
    assert result.restarts == restarts(sup), "an escalated error is not restarted"
    assert [e["actor"] for e in events(tmp_path / "run", "raise")] == ["drafter.0"]
    assert 4 not in result.committed and len(result.committed) < N


def test_a_hung_actor_is_killed_by_health_and_restarted(tmp_path):
    sup = job(tmp_path, hang_timeout_s=0.3, fates={("target.0", 5): "hang"})
    result = sup.run()
    assert result.state is JobState.DONE, result.reason
    assert_all_once(sup, result)
    assert result.restarts == restarts(sup, target_0=1)
    hang = events(tmp_path / "run", "hang")
    assert [h["actor"] for h in hang] == ["target.0"] and hang[0]["reason"].startswith("no heartbeat for")
    died = events(tmp_path / "run", "died")
    assert len(died) == 1 and died[0]["reason"].startswith("hung: no heartbeat for") and 5 in died[0]["put_back"]


# -- gangs and the fork server, in memory ------------------------------------------


def gang_job(tmp_path, n=N, **script):
    """Loader -> a target gang of two ranks -> one drafter, in memory."""
    rt = {k: script.pop(k) for k in ("max_restarts", "restart_window_s", "hang_timeout_s") if k in script}
    sup, _ = toy_job(runtime(tmp_path, **rt), n_batches=n, target_gang=2, group=MemoryGroup.factory(**script))
    return sup


def test_a_gang_whose_rank_dies_ends_and_restarts_as_one_actor(tmp_path):
    sup = gang_job(tmp_path, fates={("target.0", 9): "rank dies"})
    result = sup.run()
    assert result.state is JobState.DONE, result.reason
    assert_all_once(sup, result)
    assert result.restarts == {"loader.0": 0, "target.0": 1, "drafter.0": 0}
    died = events(tmp_path / "run", "died")
    assert [(d["actor"], d["reason"]) for d in died] == [("target.0", "rank 1 killed by SIGKILL")]
    assert 9 in died[0]["put_back"]
    spawns = [e for e in events(tmp_path / "run", "spawn") if e["actor"] == "target.0"]
    assert len(spawns) == 2 and all(len(e["ranks"]) == 2 for e in spawns)
    assert len(set(spawns[0]["ranks"]) | set(spawns[1]["ranks"])) == 4, "a rank outlived its gang"


def test_a_gangs_hung_rank_is_killed_by_the_supervisor_and_the_gang_restarted(tmp_path):
    sup = gang_job(tmp_path, hang_timeout_s=0.3, fates={("target.0", 6): "rank hangs"})
    result = sup.run()
    assert result.state is JobState.DONE, result.reason
    assert_all_once(sup, result)
    assert result.restarts["target.0"] == 1
    hang = events(tmp_path / "run", "hang")
    assert [h["actor"] for h in hang] == ["target.0"] and hang[0]["reason"].startswith("rank 1: no heartbeat")
    died = events(tmp_path / "run", "died")
    assert len(died) == 1 and died[0]["reason"].startswith("rank 1 hung: rank 1: no heartbeat")


def test_a_lost_fork_server_is_one_restart_event_and_no_actor_is_charged(tmp_path):
    sup = gang_job(tmp_path, server=True, server_fates={12: "die"})
    first = sup.group.server_pid
    result = sup.run()
    assert result.state is JobState.DONE, result.reason
    assert_all_once(sup, result)
    assert result.restarts == {"loader.0": 0, "target.0": 0, "drafter.0": 0, "forkserver": 1}
    assert all(c.policy.recent == 0 for c in sup.children), "an actor's restart intensity was charged"
    run = tmp_path / "run"
    lost = events(run, "forkserver_lost")
    assert [(e["pid"], e["reason"]) for e in lost] == [(first, f"the fork server (pid {first}) killed by SIGKILL")]
    died = events(run, "died")
    assert sorted(d["actor"] for d in died) == ["drafter.0", "loader.0", "target.0"]
    assert all("its fork server was lost" in d["reason"] and d["decision"] == "restart" for d in died)
    servers = [e["pid"] for e in events(run, "forkserver")]
    assert servers[0] == first and len(servers) == 2 and sup.group.server_pid == servers[1]
    assert sup.status()["forkserver_restarts"] == 1


def test_a_stopped_fork_server_is_lost_at_the_next_fork_and_replaced(tmp_path):
    """Stopped, it serves no fork; the actors it forked go on until one dies: that death
    is the actor's own (charged), the failed fork is the server's loss."""
    sup = gang_job(tmp_path, server=True, server_fates={10: "stop"}, fates={("drafter.0", 14): "die"})
    result = sup.run()
    assert result.state is JobState.DONE, result.reason
    assert_all_once(sup, result)
    assert result.restarts == {"loader.0": 0, "target.0": 0, "drafter.0": 1, "forkserver": 1}
    lost = events(tmp_path / "run", "forkserver_lost")
    assert len(lost) == 1 and "is stopped and did not fork within 10s" in lost[0]["reason"]


def test_a_fork_server_lost_past_its_intensity_gives_way_to_spawn(tmp_path):
    sup = gang_job(tmp_path, max_restarts=1, restart_window_s=300, server=True,
                   server_fates={8: "die", 20: "die"})
    result = sup.run()
    assert result.state is JobState.DONE, result.reason
    assert_all_once(sup, result)
    assert result.restarts["forkserver"] == 2
    assert sup.group.start_method == "spawn" and sup.status()["forkserver_pid"] is None
    given_up = events(tmp_path / "run", "forkserver_given_up")
    assert len(given_up) == 1 and "lost 2 times within 300s (max_restarts=1)" in given_up[0]["reason"]


def test_a_replacement_server_that_will_not_start_gives_way_to_spawn(tmp_path):
    sup = gang_job(tmp_path, server=True, server_fates={8: "die"}, replace_failures=1)
    result = sup.run()
    assert result.state is JobState.DONE, result.reason
    assert_all_once(sup, result)
    assert sup.group.start_method == "spawn"
    (given_up,) = events(tmp_path / "run", "forkserver_given_up")
    assert "a new one did not start: RuntimeError: the new server did not start (told to)" in given_up["reason"]
