"""``launch.py taps``: the candidate sets it builds, the runs it compares, its refusals."""

import json

import pytest

from dflash_actors.config import ConfigError, load_config
from dflash_actors.tools import taps
from tests.support.pipeline import ROOT, SMALL


def test_candidates_parse_sorted_distinct_and_refuse_nonsense():
    assert taps.parse_candidates("27,1 14,27;20") == [(1, 27), (14, 27), (20,)]
    assert taps.parse_candidates("1,27 27,1") == [(1, 27)]          # the same set once
    for bad in ("1,x", "1,1", "-1,3", " ; "):
        with pytest.raises(ConfigError, match="--candidates"):
            taps.parse_candidates(bad)


def test_search_spreads_single_layers_then_combines_the_best():
    assert taps.grid_layers(30, 6) == [(1,), (6,), (12,), (17,), (23,), (28,)]     # never the last layer
    assert taps.grid_layers(4, 10) == [(1,), (2,)]                 # no layer twice on a short target
    ranked = [(23,), (29,), (12,), (1,)]
    assert taps.combined(ranked, [2, 3, 9]) == [(23, 29), (12, 23, 29)]


def test_ranking_is_paired_against_the_control():
    def row(t, tokens):
        return {"taps": list(t), "walk_tau": sum(tokens) / len(tokens), "walk_tokens": tokens,
                "walk_steps": [1] * len(tokens)}
    rows = taps.ranked([row((2,), [10, 11, 12, 13]), row((1, 3), [12, 13, 14, 15]), row((0,), [9, 12, 12, 14])],
                       control=(2,))
    assert [r["taps"] for r in rows] == [[1, 3], [0], [2]]
    assert rows[0]["versus_control"] == {"difference": 2.0, "ci95": [2.0, 2.0], "better": True}
    assert rows[1]["versus_control"]["better"] is False and rows[2]["control"]
    assert "walk_tokens" not in rows[0]


def test_taps_ranks_given_sets_with_the_control_and_measures_each_as_alone(cache_dir, tmp_path, capsys):
    """Each candidate's figures are those of ``measure`` for it alone (the reference
    trainer with those taps, then the walk over the held-out texts); the control is
    always measured; rows come best first."""
    # The pipeline tests' data, so the session's tiny target is theirs too (fitting one costs 20 s).
    sets = [*SMALL[:2], f"data.cache_dir={cache_dir}"]
    args = ["--config", str(ROOT / "configs/default.yaml"), *(a for s in sets for a in ("--set", s)),
            "--steps", "2", "--texts", "3", "--candidates", "0,1 1", "--out", str(tmp_path / "taps.json")]
    assert taps.main(args) == 0
    report = json.loads((tmp_path / "taps.json").read_text())
    assert report == json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    control = report["control"]
    assert [sorted(r["taps"]) for r in report["ranked"]] and control in [r["taps"] for r in report["ranked"]]
    assert sorted(map(tuple, (r["taps"] for r in report["ranked"]))) == sorted([(0, 1), (1,), tuple(control)])
    taus = [r["walk_tau"] for r in report["ranked"]]
    assert taus == sorted(taus, reverse=True) and report["best"] == report["ranked"][0]["taps"]
    cfg = load_config(ROOT / "configs/default.yaml", sets)
    alone = taps.measure(cfg, (0, 1), 2, report["heldout"], 3, 1)
    got = next(r for r in report["ranked"] if r["taps"] == [0, 1])
    for key in ("steps", "walk_tau", "walk_ci95", "simulated_tau", "loss"):
        assert got[key] == alone[key], key
    assert got["steps"] == 2 and len(alone["walk_tokens"]) == got["texts"] == 3
    # Each candidate trained on its own taps (after 2 steps their walks may tie; their losses do not).
    assert got["loss"] != next(r for r in report["ranked"] if r["taps"] == [1])["loss"]


@pytest.mark.parametrize("args, message", [
    (["--candidates", "1,9"], "layer 9 does not exist in a 4-layer target"),
    (["--candidates", "1,3"], "layer 3 is the target's last layer"),
    (["--candidates", "1,x"], "is not a comma-separated list"),
    (["--sizes", "1"], "--sizes"),
    (["--steps", "0"], "must each be at least 1"),
    (["--set", "eval.data=/nonexistent/heldout"], "eval.data: no dataset at /nonexistent/heldout"),
])
def test_bad_input_is_one_line_before_any_run(cache_dir, args, message, capsys):
    assert taps.main(["--set", f"data.cache_dir={cache_dir}", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
