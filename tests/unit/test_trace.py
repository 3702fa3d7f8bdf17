"""The trace recorder and merger, without processes."""

import json

from dflash_actors.runtime import trace


def test_window_keeps_the_first_and_last_batches_and_batchless_spans():
    w = trace.Window(first=10, end=100, n=5)
    assert [b for b in range(0, 100) if w.keeps(b)] == list(range(0, 15)) + list(range(95, 100))
    assert w.keeps(-1)


def test_parts_merge_into_a_chrome_trace_with_one_named_track_each(tmp_path):
    a = trace.Tracer(tmp_path / "trace" / "a.1.jsonl", track=1, window=trace.Window(0, 100, 2))
    for b in range(6):
        with a.span("work", b, bytes=8):
            pass
    a.instant("died loader.0")
    a.close()
    sup = trace.Tracer(tmp_path / "trace" / "supervisor.2.jsonl", track=0)
    sup.record("dispatch", 5.0, 5.5, 0)
    sup.close()
    # A part a kill cut short ends in half a line: that line is dropped, not fatal.
    with open(tmp_path / "trace" / "b.3.jsonl", "w") as f:
        f.write('{"name": "work", "ph": "X", "ts": 1.0, "dur": 2.0, "tid": 2, "args": {}}\n{"name": "wo')
    out = trace.merge(tmp_path, {0: "supervisor", 1: "loader.0", 2: "target.0"})
    doc = json.loads(out.read_text())
    assert not (tmp_path / "trace").exists()
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "supervisor", 1: "loader.0", 2: "target.0"}
    spans = trace.load(out)
    assert sorted(s["args"]["batch"] for s in spans if s["track"] == "loader.0") == [0, 1]   # window of 2
    assert {s["track"] for s in spans} == {"supervisor", "loader.0", "target.0"}
    assert min(e["ts"] for e in doc["traceEvents"] if "ts" in e) == 0
    assert all(e["ph"] in ("X", "i", "M") and e["pid"] == 1 for e in doc["traceEvents"])
    assert all(s["dur"] >= 0 for s in spans)
    assert trace.origin(out) > 0


def test_a_disabled_tracer_writes_nothing(tmp_path):
    t = trace.Tracer(None, track=1)
    with t.span("work", 0):
        pass
    t.record("x", 0.0, 1.0)
    t.instant("y")
    t.flush()
    assert not t.enabled and list(tmp_path.iterdir()) == []
