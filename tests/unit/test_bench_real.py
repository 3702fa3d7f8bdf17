"""bench_real's own options: more sampled data per prompt, and the refusals that keep it honest."""

import pytest

from benchmarks import bench_real


def test_repeated_puts_each_prompt_k_times_in_a_row(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "a"}]}\n\nplain b\nplain c\n', encoding="utf-8")
    out = bench_real.repeated(src, tmp_path / "sub" / "x.jsonl", 3, limit=2)
    assert out.read_text(encoding="utf-8").splitlines() == [
        '{"messages": [{"role": "user", "content": "a"}]}'] * 3 + ["plain b"] * 3
    assert bench_real.repeated(src, tmp_path / "all.jsonl", 1).read_text(encoding="utf-8").count("\n") == 3


@pytest.mark.parametrize("argv", [["--samples-per-prompt", "2"],            # greedy: 2 identical copies
                                  ["--samples-per-prompt", "0"],
                                  ["--temperature", "-1"]])
def test_refuses_options_that_add_no_data(argv, capsys):
    # Refused before anything is loaded or prepared (and whether SmolLM2 is installed or not).
    with pytest.raises(SystemExit) as e:
        bench_real.main(argv)
    assert e.value.code == 2
    assert "--samples-per-prompt" in capsys.readouterr().err


def test_external_prompts_are_other_peoples_and_distinct():
    # The external set measures prompts the project did not write: none may repeat one of ours
    # (that would measure the held-out style again) or each other, and each is one user turn.
    import json

    def texts(name):
        return [json.loads(line)["messages"] for line in (bench_real.PROMPTS / name).read_text().splitlines()]

    external = texts("external.jsonl")
    ours = {m[-1]["content"] for name in ("train.jsonl", "heldout.jsonl") for m in texts(name)}
    assert len(external) == 64
    assert all(len(m) == 1 and m[0]["role"] == "user" and m[0]["content"].isascii() for m in external)
    contents = [m[0]["content"] for m in external]
    assert len(set(contents)) == len(contents) and not set(contents) & ours


def test_joined_takes_the_first_files_limit_and_all_of_the_others(tmp_path):
    from benchmarks.bench_real import count_prompts, joined

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("one\ntwo\n\nthree\n")
    b.write_text("four\nfive\n")
    out = joined([a, b], tmp_path / "all.jsonl", 2)
    assert out.read_text() == "one\ntwo\nfour\nfive\n" and count_prompts(out) == 4
    assert joined([a, b], tmp_path / "all.jsonl", None).read_text().splitlines()[:3] == ["one", "two", "three"]


def test_wheel_prompts_never_reach_an_evaluation_set():
    """``wheels.jsonl`` trains: none of its prompts may be a held-out or external one (the
    evaluation would then measure memorised text), nor repeat one of its own."""
    import json

    def norm(messages):
        return " ".join(messages[-1]["content"].lower().split())

    def texts(name):
        return [json.loads(line)["messages"] for line in (bench_real.PROMPTS / name).read_text().splitlines()]
    wheels = texts("wheels.jsonl")
    assert len(wheels) > 800 and all(len(m) == 1 and m[0]["role"] == "user" for m in wheels)
    mine = [norm(m) for m in wheels]
    evaluated = {norm(m) for name in ("heldout.jsonl", "external.jsonl") for m in texts(name)}
    assert len(set(mine)) == len(mine) and not set(mine) & evaluated
