"""The real-model journey on a tiny chat target: prepare (and its resume after kill -9),
train, evaluate with the template check, baselines and lossless decoding."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from dflash_actors.config import load_config
from dflash_actors.data.dataset import open_dataset
from dflash_actors.eval.parity import main as evaluate_main
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.prepare.regenerate import (
    PrepareError,
    SamplingSettings,
    encode_prompt,
    load_tokenizer,
    prepare,
    read_metadata,
)
from tests.support.pipeline import ROOT, SMALL

PROMPTS = [{"messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i + 1}?"}]}
           for i in range(7)] + [{"messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Name a colour."},
                                               {"role": "assistant", "content": "dropped and regenerated"}]}]


@pytest.fixture(scope="module")
def chat(chat_target, tmp_path_factory):
    """``(target dir, prompts file)`` of the tiny chat target."""
    prompts = tmp_path_factory.mktemp("chat") / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS) + "plain text line prompt\n")
    return chat_target, prompts


def test_prepare_writes_the_target_text_behind_the_chat_template(chat, tmp_path):
    target, prompts = chat
    out = prepare(str(target), prompts, tmp_path / "ds", sampling=SamplingSettings(max_new_tokens=12),
                  batch_size=3, shard_size=4, progress=False, threads=1)
    ds = open_dataset(load_config(ROOT / "configs/default.yaml").data, progress=False, path=out)
    meta = read_metadata(out)
    assert len(ds) == len(PROMPTS) + 1 == meta["completions"] and meta["template"]["enable_thinking"] is False
    tok = load_tokenizer(target)
    from dflash_actors.prepare.regenerate import TemplateSettings
    settings = TemplateSettings(**meta["template"])
    for i in (0, 7, 8):
        ids, mask = ds.sample(i)
        msgs = PROMPTS[i]["messages"][:2] if i < 8 else [{"role": "user", "content": "plain text line prompt"}]
        prompt = encode_prompt(tok, msgs, settings)
        # the prompt exactly as the template renders it, unsupervised; then 1..12 generated tokens
        assert ids[:len(prompt)].tolist() == prompt and not mask[:len(prompt)].any()
        assert mask[len(prompt):].all() and 1 <= len(ids) - len(prompt) <= 12
        # greedy: the completion is the target's own continuation
        from transformers import AutoModelForCausalLM

        from dflash_actors.eval.decode import greedy_cached
        from dflash_actors.models.target import TargetModel
        t = TargetModel(AutoModelForCausalLM.from_pretrained(target), [0])
        want, _ = greedy_cached(t, torch.tensor(prompt), 12, (tok.eos_token_id,))
        assert ids.tolist() == want.tolist()
    assert "prompt" in open(out / "prepare.json").read()
    engine = meta["engine"]         # continuous batching: rows refill at once and leave at the end
    assert (engine["engine"], engine["batching"], engine["idle_row_steps"]) == ("in-process", "continuous", 0)
    assert engine["row_steps"] > 0


def test_prepare_generates_in_the_dtype_asked_records_it_and_refuses_an_unknown_one(chat, tmp_path):
    # On the tiny target bf16 and fp32 greedy texts agree token for token (checked), so the
    # text cannot tell which ran: the generator's model is what must be bf16.
    from dflash_actors.prepare.generate import InProcessEngine
    target, prompts = chat
    tok = load_tokenizer(target)
    for dtype, want in (("auto", torch.float32), ("bfloat16", torch.bfloat16)):
        gen = InProcessEngine(target, tok, SamplingSettings(dtype=dtype), 1, "cpu", None)
        assert next(gen.model.parameters()).dtype == want
    out = prepare(str(target), prompts, tmp_path / "ds", sampling=SamplingSettings(max_new_tokens=10, dtype="bfloat16"),
                  batch_size=2, shard_size=4, limit=3, progress=False, threads=1)
    assert read_metadata(out)["sampling"]["dtype"] == "bfloat16" and read_metadata(out)["completions"] == 3
    with pytest.raises(PrepareError, match="--dtype"):
        prepare(str(target), prompts, tmp_path / "bad", sampling=SamplingSettings(dtype="int8"), progress=False)


def _prepare_cmd(target, prompts, out):
    return [sys.executable, str(ROOT / "launch.py"), "prepare", "--target", str(target), "--prompts", str(prompts),
            "--out", str(out), "--max-new-tokens", "16", "--batch-size", "1", "--shard-size", "1",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "5", "--threads", "1"]


@pytest.mark.slow      # make slow: 20 s, and prepare has no other kill path
def test_prepare_resumes_after_kill_without_duplicates(chat, tmp_path):
    """Sampled (seeded per shard), killed after its first shards, rerun: the result equals
    an uninterrupted run's, row for row."""
    target, prompts = chat
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_prepare_cmd(target, prompts, killed), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = tmp_path / "killed.partial"
    deadline = time.monotonic() + 120
    while len(list(partial.glob("shard-*.npz"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list(partial.glob("shard-*.npz")))
    assert 2 <= done < len(PROMPTS) + 1, "the kill must land mid-run"
    assert not (killed / "state.json").exists()
    r = subprocess.run(_prepare_cmd(target, prompts, killed), cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not partial.exists()
    clean = prepare(str(target), prompts, tmp_path / "clean", batch_size=1, shard_size=1, threads=1, progress=False,
                    sampling=SamplingSettings(temperature=0.8, top_p=0.9, max_new_tokens=16, seed=5))
    data_cfg = load_config(ROOT / "configs/default.yaml").data
    a, b = (open_dataset(data_cfg, progress=False, path=p) for p in (killed, clean))
    assert len(a) == len(b) == len(PROMPTS) + 1
    for i in range(len(a)):
        assert np.array_equal(a.sample(i)[0], b.sample(i)[0]) and np.array_equal(a.sample(i)[1], b.sample(i)[1])
    # Other settings do not silently mix into a partial run.
    (tmp_path / "mixed.partial").mkdir()
    (tmp_path / "mixed.partial" / "manifest.json").write_text(json.dumps({"format": 1, "seed": "other"}))
    with pytest.raises(PrepareError, match="was started with a different"):
        prepare(str(target), prompts, tmp_path / "mixed", progress=False)


def test_evaluate_reports_parity_and_refuses_a_template_mismatch(chat, cache_dir, tmp_path, capsys):
    target, prompts = chat
    ds = prepare(str(target), prompts, tmp_path / "ds", sampling=SamplingSettings(max_new_tokens=12),
                 batch_size=4, shard_size=8, progress=False, threads=1)
    cfg = load_config(ROOT / "configs/default.yaml", SMALL + [f"data.cache_dir={cache_dir}", f"target.path={target}",
                                                             "drafter.block_size=4"])
    from dflash_actors.models.drafter_start import build_drafter
    from dflash_actors.models.head import load_head
    drafter_dir = build_drafter(cfg, load_head(cfg)).save_pretrained(tmp_path / "drafter")
    assert DFlashDrafter.from_pretrained(drafter_dir).mask_token_id == 102    # first row past the tokenizer
    argv = [str(drafter_dir), "--prompts", str(prompts), "--target", str(target), "--dataset", str(ds),
            "--max-new-tokens", "10", "--limit", "4", "--threads", "1", "--json", str(tmp_path / "report.json")]
    assert evaluate_main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["results"]) == {"trained", "untrained", "ngram", "repeat"}
    for r in report["results"].values():
        assert r["real"]["lossless"] and 1.0 <= r["real"]["tau"] <= 4 and len(r["real"]["per_position"]) == 3
        assert 1.0 <= r["simulated"]["tau"] <= 4
    assert "matches" in report["template_check"] and "real tau" in out and "z-lab" in out
    # Intervals over the 4 prompts: tau's around its mean, each ratio's paired by prompt.
    trained = report["results"]["trained"]
    lo, hi = trained["real"]["tau_ci95"]
    assert lo <= trained["real"]["tau"] <= hi and len(trained["real"]["per_prompt"]) == 4
    assert set(trained["ratio_to"]) == {"untrained", "ngram", "repeat"}
    for r in trained["ratio_to"].values():
        assert r["ci95"][0] <= r["ratio"] <= r["ci95"][1]
    assert "95% interval over prompts" in out
    # The dataset was made without a system prompt: evaluating with one is refused.
    assert evaluate_main(argv + ["--system-prompt", "You are terse."]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: chat template mismatch") and "system_prompt" in err[-1]
