"""``prepare --self-prompts``: prompts written by the target from its chat template's
user-turn header, filtered, deduplicated, resumable, then regenerated into a dataset."""

import json

import pytest

from dflash_actors.config import load_config
from dflash_actors.data.dataset import open_dataset
from dflash_actors.prepare import self_prompts
from dflash_actors.prepare.regenerate import load_tokenizer, read_metadata, read_prompts
from dflash_actors.prepare.regenerate import main as prepare_main
from dflash_actors.prepare.self_prompts import (
    SelfPromptError,
    SelfPromptSettings,
    user_turn_header,
    write_self_prompts,
)
from tests.support.chat import tiny_chat_target
from tests.support.pipeline import ROOT

# The tiny target ends a turn rarely: short samples, a low floor, enough draws.
SETTINGS = SelfPromptSettings(6, max_tokens=24, min_chars=2, seed=3)


def test_header_is_the_template_up_to_the_user_message(chat_target):
    tok = load_tokenizer(chat_target)
    assert user_turn_header(tok) == "<|im_start|>user\n"
    assert user_turn_header(tok, "Be brief.") == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{% if m['role'] != 'user' %}{{ m['content'] }}{% endif %}{% endfor %}",
     "has no user turn"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "puts nothing before a user's message"),
    ("{{ raise_exception('users not welcome') }}", "refuses a user message"),
])
def test_a_template_without_a_user_turn_is_one_line_before_any_weights(chat_target, tmp_path, template, message,
                                                                     capsys, monkeypatch):
    target = tiny_chat_target(chat_target, tmp_path / "odd", template=template)
    with pytest.raises(SelfPromptError, match=message):
        user_turn_header(load_tokenizer(target))
    monkeypatch.setattr(self_prompts, "InProcessEngine", None)      # never reached
    assert prepare_main(["--target", str(target), "--self-prompts", "4", "--out", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --self-prompts: ") and message in err and err.count("\n") == 1


def test_kept_prompts_are_finished_distinct_and_clean():
    kept = self_prompts.Kept(4, 3, ["<|im_start|>", ""])
    for text in [None, " ab ", "Hello  there", "hello there", "x<|im_start|>y", "A question?", "Another one",
                 "and more", "past the count"]:
        kept.offer(text)
    assert kept.prompts == ["Hello  there", "A question?", "Another one", "and more"] and kept.full
    assert kept.dropped == {"unfinished": 1, "short": 1, "special_tokens": 1, "duplicate": 1}
    assert kept.sampled == 8       # the one offered once full is not counted


def test_self_prompts_resume_after_a_crash_to_what_an_unbroken_run_writes(chat_target, tmp_path, monkeypatch):
    tok = load_tokenizer(chat_target)
    clean = write_self_prompts(chat_target, tok, tmp_path / "clean.jsonl", SETTINGS, batch_size=4, shard_size=4)
    assert clean["sampled"] == clean["kept"] + sum(clean["dropped"].values()) and 1 <= clean["kept"] <= 6
    prompts = [m[0]["content"] for m in read_prompts(tmp_path / "clean.jsonl")]
    assert len(prompts) == clean["kept"] and len({" ".join(p.lower().split()) for p in prompts}) == len(prompts)

    calls, shard = [], self_prompts.InProcessEngine.shard

    def dies_on_the_second(engine, *args):
        calls.append(args[-1])
        if len(calls) == 2:
            raise RuntimeError("killed")
        return shard(engine, *args)
    monkeypatch.setattr(self_prompts.InProcessEngine, "shard", dies_on_the_second)
    with pytest.raises(RuntimeError, match="killed"):
        write_self_prompts(chat_target, tok, tmp_path / "broken.jsonl", SETTINGS, batch_size=4, shard_size=4)
    monkeypatch.setattr(self_prompts.InProcessEngine, "shard", shard)
    assert sorted(p.name for p in (tmp_path / "broken.jsonl.partial").glob("shard-*")) == ["shard-00000.json"]
    resumed = write_self_prompts(chat_target, tok, tmp_path / "broken.jsonl", SETTINGS, batch_size=4, shard_size=4)
    assert (tmp_path / "broken.jsonl").read_text() == (tmp_path / "clean.jsonl").read_text()
    assert resumed == clean
    assert not (tmp_path / "broken.jsonl.partial").exists()
    with pytest.raises(SelfPromptError, match="was started with a different header"):
        (tmp_path / "other.jsonl.partial").mkdir()
        (tmp_path / "other.jsonl.partial" / "manifest.json").write_text(json.dumps({"kind": "self", "seed": 99}))
        write_self_prompts(chat_target, tok, tmp_path / "other.jsonl", SETTINGS, batch_size=4, shard_size=4)


def test_prepare_self_prompts_makes_a_dataset_of_them(chat_target, tmp_path, capsys):
    out = tmp_path / "ds"
    args = ["--target", str(chat_target), "--self-prompts", "6", "--prompt-max-tokens", "24", "--seed", "3",
            "--max-new-tokens", "8", "--batch-size", "4", "--shard-size", "4", "--threads", "1", "--out", str(out)]
    assert prepare_main(args) == 0, capsys.readouterr().err
    meta = read_metadata(out)
    written = read_prompts(tmp_path / "ds.prompts.jsonl")
    source = meta["prompt_source"]
    assert source["kind"] == "self" and source["kept"] == len(written) == meta["completions"]
    assert meta["prompts"] == str(tmp_path / "ds.prompts.jsonl")
    ds = open_dataset(load_config(ROOT / "configs/default.yaml").data, progress=False, path=out)
    assert len(ds) == len(written) and all(ds.sample(i)[1].any() for i in range(len(ds)))


def test_self_prompts_refuse_what_they_cannot_do(chat_target, tmp_path, capsys):
    base = ["--target", str(chat_target), "--out", str(tmp_path / "ds")]
    for extra, message in ((["--self-prompts", "4", "--prompts", "x.jsonl"], "one of them"),
                           ([], "one of them"),
                           (["--self-prompts", "4", "--server", "http://127.0.0.1:9"], "not with --server"),
                           (["--self-prompts", "0"], "--self-prompts must be >= 1"),
                           (["--self-prompts", "4", "--prompt-temperature", "0"], "--prompt-temperature must be > 0")):
        assert prepare_main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (extra, err)
