"""``tools.chaos.restart_gap``: the silence ``make chaos`` holds every restart to, read
from ``events.log`` as the supervisor writes it."""

import json

from dflash_actors.tools.chaos import restart_gap


def write(tmp_path, events):
    (tmp_path / "events.log").write_text("".join(json.dumps({"mono": t, "event": e, **kw}) + "\n"
                                                 for t, e, kw in events))
    return tmp_path


def test_the_stall_of_issue_55_is_a_long_silence_and_training_is_none(tmp_path):
    # Issue 55's run: a new server forks six actors, then nothing until they are all ready.
    stall = [(0.0, "start", {}), (1.0, "forkserver", {})]
    stall += [(6.1 + i / 100, "spawn", {"actor": f"a.{i}"}) for i in range(6)]
    stall += [(1076.0 + i / 100, "ready", {"actor": f"a.{i}"}) for i in range(6)]
    assert 1069 < restart_gap(write(tmp_path, stall)) < 1070
    # Quiet training between restarts counts for nothing; a restart that comes back does.
    calm = [(0.0, "start", {}), (0.5, "spawn", {"actor": "a.0"}), (2.0, "ready", {"actor": "a.0"}),
            (900.0, "died", {"actor": "a.0", "decision": "restart"}), (903.5, "spawn", {"actor": "a.0"}),
            (904.0, "starting", {"actor": "a.0"}), (905.0, "ready", {"actor": "a.0"}), (2000.0, "end", {})]
    assert restart_gap(write(tmp_path, calm)) == 3.5


def test_a_new_supervisor_starts_counting_afresh(tmp_path):
    # A supervisor killed with an actor on its way up: the next life's log begins clean.
    events = [(0.0, "start", {}), (1.0, "spawn", {"actor": "a.0"}), (50.0, "start", {}),
              (51.0, "spawn", {"actor": "a.0"}), (53.0, "ready", {"actor": "a.0"})]
    assert restart_gap(write(tmp_path, events)) == 2.0
    assert restart_gap(tmp_path / "nowhere") == 0.0
