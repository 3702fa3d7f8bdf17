"""The run plotter: a live, resumed metrics.jsonl reads back one line per step (the
last), skipping what does not parse; the PNG is written where asked; bad input and a
missing matplotlib end with their own exit codes and one line saying why."""

import json
import sys

import pytest

from dflash_actors.observe.plot import at, load, main, series

T0 = 1764480000.0


def _step(n, loss=5.0, **extra):
    return {"kind": "step", "step": n, "epoch": 0, "time": T0 + n, "loss": loss, "tau": 1 + n / 30,
            "slot_acc": [0.3 + n / 100, 0.1 + n / 200, 0.05], "lr": 3e-4, "grad_norm": 1.7, "tokens": 4096,
            "tokens_per_s": None if n == 1 else 1800.0 + n, "skipped": loss is None,
            "stages": {s: {"busy_s": 0.5, "wait_s": 0.5} for s in ("loader", "target", "drafter", "optimizer")},
            **extra}


def _resources(n):
    actors = {a: {"pid": 100 + i, "rss_mb": 300.0, "cpu_pct": 3.0, "gpu_mem_mb": None, "busy_pct": 10.0 * i + n}
              for i, a in enumerate(("loader.0", "target.0", "target.1", "drafter.0", "optimizer.0"))}
    actors["target.1"]["busy_pct"] = None if n == 2 else 40.0  # restarting
    return {"kind": "resources", "time": T0 + 4 * n, "step": 4 * n, "actors": actors,
            "host": {"cpu_pct": 95.0, "mem_used_mb": 8000.0, "mem_total_mb": 24000.0}}


@pytest.fixture
def run(tmp_path):
    """A run that crashed after step 20 and resumed from step 18: 30 distinct steps (19 and 20
    logged twice, the resumed lines with loss 1.0), step 5 skipped, 2 evaluations (the second with
    real decoding), 5 resource samples, garbage of three sorts, and a half-written last line."""
    rows = []
    for n in range(1, 21):
        rows.append(_step(n, loss=None if n == 5 else 5.0 - n / 10))
        if n % 10 == 0:
            rows.append({"kind": "eval", "step": n, "time": T0 + n,
                         "simulated": {"tau": 1.5 + n / 100, "per_position": [0.5, 0.3, None], "anchors": 512},
                         **({"real": {"tau": 1.7, "tau_pooled": 1.75, "per_position": [0.45, 0.2, 0.1],
                                      "verify_steps": 80}} if n == 20 else {}), "wall_s": 3.2})
        if n % 4 == 0:
            rows.append(_resources(n // 4))
    rows += [_step(n, loss=1.0) for n in range(19, 31)]
    lines = [json.dumps(r) for r in rows]
    lines[3:3] = ["not json", "[1, 2]", json.dumps({"kind": "checkpoint", "step": 3})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + json.dumps(_step(31))[:40])
    return tmp_path


def test_load_dedups_skips_and_ignores(run):
    data = load(run / "metrics.jsonl")
    assert [s["step"] for s in data["steps"]] == list(range(1, 31))  # 31 was half-written
    assert [s["loss"] for s in data["steps"][18:20]] == [1.0, 1.0]  # the resumed lines won
    assert (len(data["evals"]), len(data["resources"])) == (2, 5)
    xs, ys = series(data["steps"], at("loss"))
    assert 5 not in xs and len(xs) == len(ys) == 29
    assert series(data["resources"], at("actors", "target.1", "busy_pct"))[0] == [4, 12, 16, 20]
    assert series(data["evals"], at("real", "tau")) == ([20], [1.7])


def test_main_writes_png(run, capsys):
    pytest.importorskip("matplotlib")
    assert main([str(run)]) == 0
    png = (run / "plot.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    assert capsys.readouterr().out == f"wrote {run / 'plot.png'}: 30 steps, 2 evaluations, 5 resource samples\n"


def test_out_option_and_bare_step_lines(tmp_path, capsys):
    """Step lines with nothing but their step still plot: every panel says it has no data."""
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"kind": "step", "step": n}) + "\n" for n in (1, 2)))
    out = tmp_path / "figs" / "run.png"
    assert main([str(tmp_path), "-o", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and not (tmp_path / "plot.png").exists()
    assert capsys.readouterr().out == f"wrote {out}: 2 steps, 0 evaluations, 0 resource samples\n"


def test_bad_input_exits_2(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "metrics.jsonl" in err and err.count("\n") == 1
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 10, "simulated": {"tau": 1.5}}) + "\n")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "metrics.jsonl" in err and "no step lines" in err


def test_without_matplotlib_exits_1(run, monkeypatch, capsys):
    for name in ("matplotlib", "matplotlib.pyplot", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import` raise ImportError
    assert main([str(run)]) == 1
    err = capsys.readouterr().err
    assert "pip install matplotlib" in err and err.count("\n") == 1
    assert not (run / "plot.png").exists()
