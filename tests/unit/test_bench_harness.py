"""benchmarks.harness's protocol from both sides: records on stdout, progress on stderr,
a skip as a record; ``make bench``'s reading of a script that fails; and bench_startup's
split of a restart (kill, ``died``, ``spawn``, Ready), which replaced bench_restart's own."""

import json
from pathlib import Path

from benchmarks import bench_startup, harness, run_all


def test_say_is_progress_on_stderr_and_emit_the_only_stdout_line(capsys):
    harness.say("half way")
    harness.emit({"bench": "x", "n": 1})
    out, err = capsys.readouterr()
    assert err == "# half way\n"
    assert harness.records("note\n" + out) == [json.loads(out)]
    assert json.loads(out)["n"] == 1


def test_a_skip_is_a_record_with_its_reason(capsys):
    rec = harness.skipped("real", harness.SMOLLM2_MISSING)
    assert rec["skipped"] == harness.SMOLLM2_MISSING and json.loads(capsys.readouterr().out) == rec


def test_saved_names_land_under_results_by_date_and_paths_stay_paths():
    assert harness.result_path("gang").parent == harness.RESULTS
    assert harness.result_path("gang").name.endswith("-gang.json")
    assert harness.result_path("serve-check", ".jsonl").suffix == ".jsonl"
    assert harness.result_path("out/x") == Path("out/x") and harness.result_path("x.json") == Path("x.json")


def test_make_bench_reports_a_script_that_fails_with_its_error():
    rec = run_all.run_one(Path("bench_no_such_thing.py"))
    assert rec["bench"] == "no_such_thing" and "No module named" in rec["error"]


def test_a_restart_is_split_into_detection_respawn_and_startup():
    mine = [{"event": "died", "mono": 10.25}, {"event": "spawn", "mono": 10.5},
            {"event": "starting", "mono": 10.6}, {"event": "ready", "mono": 11.5, "startup_s": 1.0},
            {"event": "died", "mono": 20.0}]
    assert bench_startup.split(mine, 10.0) == {"detect": 0.25, "respawn": 0.25, "startup": 1.0}
    assert bench_startup.split([{"event": "ready", "mono": 11.0, "startup_s": 0.5}], 10.0) == \
        {"detect": None, "respawn": None, "startup": 0.5}
    splits = [{"detect": 0.1, "respawn": 0.2, "startup": 1.0}, {"detect": 0.3, "respawn": None, "startup": 2.0}]
    assert bench_startup.split_medians(splits) == {"detect": 0.2, "respawn": 0.2, "startup": 1.5}
