"""Hung and stuck actors, decided from heartbeats and start-up progress alone: no
processes, stand-ins that record whether anything touched them. Health only reports
whom to kill (the supervisor kills); it never kills itself."""

from dflash_actors.runtime.actor import HB, Heartbeats
from dflash_actors.runtime.children import Child, Rank, StartPhase
from dflash_actors.runtime.config import RuntimeConfig
from dflash_actors.runtime.health import Health

CFG = RuntimeConfig(hang_timeout_s=60.0, start_timeout_s=300.0, stuck_after_s=10.0)


class Proc:
    pid = 4242

    def __init__(self):
        self.killed = False

    def kill(self):
        self.killed = True


def setup(children, rows):
    hb, log = Heartbeats.allocate(rows), []
    return hb, Health(CFG, hb, lambda event, **f: log.append((event, f["actor"]))), log


def child(n, ready, spawned_at=0.0, starting=None, followers=()):
    return Child(f"a.{n}", n, None, n, proc=Proc(), ready=ready, spawned_at=spawned_at, starting=starting,
                 followers=list(followers))


def test_a_silent_ready_actor_is_reported_hung_and_a_beating_one_is_not():
    quiet, beating = child(0, True), child(1, True)
    hb, health, log = setup([quiet, beating], 2)
    hb.table[0, HB.BEAT], hb.table[1, HB.BEAT] = 1000.0, 1050.0
    assert health.next_deadline([quiet, beating]) == 1060.0 + 0.01
    hung = health.hung([quiet, beating], now=1070.0)
    assert [(h.child, h.rank) for h in hung] == [(quiet, None)]
    assert hung[0].reason.startswith("no heartbeat for 70.0s")
    assert not quiet.proc.killed and quiet.hung is None and log == [], "health decided nothing itself"
    quiet.hung = "hung: ...; killed"                      # what the supervisor marks when it kills
    assert health.hung([quiet, beating], now=1080.0) == []   # reported once


def test_start_up_counts_from_its_last_progress_not_from_the_spawn():
    loading = child(0, False, spawned_at=0.0, starting=StartPhase("load", since=0.0, last=250.0))
    hb, health, log = setup([loading], 1)
    assert health.next_deadline([loading]) == 550.0 + 0.01
    assert health.hung([loading], now=500.0) == []        # 500 s after spawn, 250 s since progress
    (hung,) = health.hung([loading], now=551.0)
    assert hung.child is loading and "no start-up progress in 'load' for 301.0s" in hung.reason


def test_an_actor_silent_since_its_fork_is_hung_at_the_start_timeout():
    """Between the fork and its first word an actor shows no phase of its own: the
    start timeout counts from the spawn (a child that never got its arguments)."""
    forked = child(0, False, spawned_at=0.0, starting=StartPhase("fork", since=0.0, last=0.0))
    hb, health, log = setup([forked], 1)
    assert health.next_deadline([forked]) == 300.0 + 0.01
    assert health.hung([forked], now=299.0) == []
    (hung,) = health.hung([forked], now=301.0)
    assert "no start-up progress in 'fork' for 301.0s" in hung.reason


def test_a_gangs_silent_rank_is_reported_once_the_gang_is_ready():
    rank = Rank(1, 1, proc=Proc())
    gang = child(0, True, followers=[rank])
    hb, health, log = setup([gang], 2)
    hb.table[0, HB.BEAT], hb.table[1, HB.BEAT] = 1000.0, 900.0
    (hung,) = health.hung([gang], now=1000.0)
    assert (hung.child, hung.rank) == (gang, rank) and hung.reason.startswith("rank 1: no heartbeat for 100.0s")
    assert not rank.proc.killed and not gang.proc.killed
    gang.ready, gang.spawned_at = False, 990.0            # starting: its ranks' beats do not count yet
    assert health.hung([gang], now=1000.0) == []


def test_stuck_is_shown_and_logged_once_each_way_and_never_killed():
    slow = child(0, True)
    hb, health, log = setup([slow], 1)
    hb.table[0, HB.BEAT] = 100.0
    for now in (105.0, 115.0, 120.0):
        health.check_stuck([slow], now)
    assert slow.stuck == "no heartbeat for 20.0 s" and log == [("stuck", "a.0")] and not slow.proc.killed
    hb.table[0, HB.BEAT] = 119.0
    health.check_stuck([slow], 121.0)
    assert slow.stuck is None and log == [("stuck", "a.0"), ("unstuck", "a.0")]
