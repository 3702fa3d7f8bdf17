"""``prepare --server`` against the small local server of ``tests/support/openai_stub.py``,
which speaks vLLM's token-id protocol (written from vLLM's documented request and response
fields, not its code) and injects faults: the token-id path, a strict server's text path,
retries, fail-fast, the checks before the first row, resume by row id after kill -9,
truncation, the re-tokenization refusal, several servers, ``--samples-per-prompt``."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from dflash_actors.config import load_config
from dflash_actors.data.dataset import open_dataset
from dflash_actors.prepare.regenerate import (
    PrepareError,
    SamplingSettings,
    TemplateSettings,
    load_tokenizer,
    main,
    prepare,
    read_metadata,
    render_prompt,
)
from dflash_actors.prepare.serving import DatasetRefused, ServerFailed, ServerSettings, agreement
from tests.support.openai_stub import PROMPTS, StubServer, hashed_model, served_chat
from tests.support.pipeline import ROOT, free_port

EOS = 2
FAST = {"backoff_s": 0.01}          # retries in tests need not wait seconds


@pytest.fixture(scope="module")
def chat(cache_dir, tmp_path_factory):
    """``(target dir, prompts file)``: the tiny target with a tokenizer covering its vocabulary."""
    return served_chat(cache_dir, tmp_path_factory.mktemp("served-chat"))


def tiny_model(target):
    """The stub's generator: the tiny target itself, greedy, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model, lock = AutoModelForCausalLM.from_pretrained(target).eval(), threading.Lock()

    def generate(prompt, max_tokens, temperature, top_p, seed):
        # OpenMP's thread count is per thread: this one must add up in the order
        # prepare's threads=1 does, or the tiny model's near-ties break differently.
        torch.set_num_threads(1)
        with lock, torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=[EOS], pad_token_id=0)
        return out[0, len(prompt):].tolist()
    return generate


def rows_of(path):
    ds = open_dataset(load_config(ROOT / "configs/default.yaml").data, progress=False, path=path)
    return [tuple(a.tolist() for a in ds.sample(i)) for i in range(len(ds))]


def completions(path):
    return [[t for t, m in zip(ids, mask) if m] for ids, mask in rows_of(path)]


def stub_of(chat, **kw):
    target, _ = chat
    return StubServer(kw.pop("generate", None) or hashed_model(EOS, range(4, 256)), load_tokenizer(target),
                      stops=(EOS,), **kw)


def run(chat, out, *urls, sampling=SamplingSettings(max_new_tokens=12), **kw):
    target, prompts = chat
    settings = {"concurrency": 2, **FAST, **kw.pop("server", {})}
    return prepare(str(target), prompts, out, sampling=sampling, shard_size=3, progress=False, threads=1,
                   server=ServerSettings(tuple(urls), **settings), **kw)


def test_token_id_path_stores_the_served_ids_which_equal_the_in_process_engine(chat, tmp_path):
    target, prompts = chat
    with stub_of(chat, generate=tiny_model(target)) as stub:
        served = run(chat, tmp_path / "served", stub.url)
    local = prepare(str(target), prompts, tmp_path / "local", sampling=SamplingSettings(max_new_tokens=12),
                    batch_size=1, shard_size=3, progress=False, threads=1)
    assert rows_of(served) == rows_of(local) and len(rows_of(served)) == len(PROMPTS)
    engine = read_metadata(served)["engine"]
    assert engine["path"] == "token_ids" and engine["retokenize_mismatch"] == 0 and engine["retried_requests"] == 0
    asked = stub.row_requests()
    tok = load_tokenizer(target)
    # The prompt went as the project's token ids; one seed per row.
    want = [tok(render_prompt(tok, p["messages"], TemplateSettings()), add_special_tokens=False)["input_ids"]
            for p in PROMPTS]
    assert sorted(r["prompt"] for r in asked) == sorted(want) and all(r["return_token_ids"] for r in asked)
    assert sorted(r["seed"] for r in asked) == list(range(len(PROMPTS)))
    ends = [ids[-1] == EOS for ids in completions(served)]
    assert any(ends) or engine["truncated"] == len(PROMPTS)
    assert engine["truncated_rows"] == [i for i, e in enumerate(ends) if not e]


def test_a_strict_server_gets_the_text_path_and_never_the_vendor_field_again(chat, tmp_path):
    target, _ = chat
    gen = hashed_model(EOS, range(4, 256), mean_len=7)      # no special token: the text round-trips
    with stub_of(chat, strict=True, generate=gen) as stub:
        out = run(chat, tmp_path / "ds", stub.url)
    engine = read_metadata(out)["engine"]
    assert engine["path"] == "text" and engine["retokenize_mismatch"] == 0
    probes = [r for r in stub.requests if r not in stub.row_requests()]
    assert [("return_token_ids" in r) for r in probes] == [False, True]      # the probe, answered 422
    assert not any("return_token_ids" in r for r in stub.row_requests())
    tok = load_tokenizer(target)
    texts = [render_prompt(tok, p["messages"], TemplateSettings()) for p in PROMPTS]
    assert sorted(r["prompt"] for r in stub.row_requests()) == sorted(texts)
    # Each row: the generator's ids; the end-of-turn token the text lost is put back.
    want = [gen(tok(t)["input_ids"], 12, 0.0, 1.0, None) for t in texts]
    assert completions(out) == want
    stopped = [i for i, w in enumerate(want) if w[-1] == EOS]
    assert engine["end_token_appended"] == len(stopped) and 0 < len(stopped) < len(PROMPTS)
    assert engine["truncated_rows"] == [i for i in range(len(PROMPTS)) if i not in stopped]
    # Sampling's top_k is not OpenAI's: a strict server never gets it either (its own default applies).
    with stub_of(chat, strict=True) as stub:
        out = run(chat, tmp_path / "sampled", stub.url, limit=2, sampling=SamplingSettings(temperature=0.7))
    assert not read_metadata(out)["engine"]["top_k_sent"] and len(stub.row_requests()) == 2
    assert not any("top_k" in r or "return_token_ids" in r for r in stub.row_requests())


def test_faults_are_retried_with_backoff_and_leave_the_data_unchanged(chat, tmp_path):
    with stub_of(chat) as stub:
        clean = run(chat, tmp_path / "clean", stub.url)
    with stub_of(chat, slow_s=1.5) as stub:
        stub.faults = ["500", None, "drop", None, "slow", None, "429", "503", None]
        out = run(chat, tmp_path / "ds", stub.url, server={"concurrency": 1, "request_timeout_s": 0.5})
        assert len(stub.row_requests()) == len(PROMPTS) + 5
    assert rows_of(out) == rows_of(clean)
    assert read_metadata(out)["engine"]["retried_requests"] == 5


def test_a_client_error_fails_at_once_and_spent_retries_name_the_server(chat, tmp_path, capsys):
    target, prompts = chat
    with stub_of(chat) as stub:
        stub.faults = ["400"]
        with pytest.raises(ServerFailed, match=r"HTTP 400 \(injected 400\) \(a client error: not retried\)"):
            run(chat, tmp_path / "ds", stub.url, server={"concurrency": 1})
        assert len(stub.row_requests()) == 1
        stub.faults = ["500"] * 2
        argv = ["--target", str(target), "--prompts", str(prompts), "--out", str(tmp_path / "ds"), "--server",
                stub.url, "--max-new-tokens", "12", "--shard-size", "3", "--concurrency", "1", "--retries", "1",
                "--threads", "1"]
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"error: --server {stub.url}: row 0 failed 2 times (--retries 1); last: HTTP 500")
        assert "rerun to go on" in err and (tmp_path / "ds.partial").is_dir()
        assert main(argv) == 0          # the same command, the server well again
        clean = run(chat, tmp_path / "clean", stub.url)
    assert rows_of(tmp_path / "ds") == rows_of(clean)


@pytest.mark.parametrize("case", ["wrong model", "two models", "nothing listening", "probe 500", "probe too slow",
                                  "not a URL"])
def test_an_unusable_server_exits_2_with_one_line_before_anything_is_written(chat, tmp_path, capsys, case):
    target, prompts = chat
    models = ("stub", "other") if case == "two models" else ("stub",)
    with stub_of(chat, models=models, slow_s=1.0) as stub:
        url = {"nothing listening": f"http://127.0.0.1:{free_port()}",
               "not a URL": "localhost:8000"}.get(case, stub.url)
        stub.probe_faults = {"probe 500": ["500"], "probe too slow": ["slow"]}.get(case, [])
        extra = ["--server-model", "Qwen/Qwen3-8B"] if case == "wrong model" else []
        code = main(["--target", str(target), "--prompts", str(prompts), "--out", str(tmp_path / "ds"),
                     "--server", url, "--request-timeout", "0.3", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    want = {"wrong model": f"--server {url} does not serve model 'Qwen/Qwen3-8B' (it lists 'stub'; see --server-model)",
            "two models": f"--server {url} serves 2 models (stub, other): name one with --server-model",
            "nothing listening": f"--server {url}: GET /v1/models failed: [Errno 111] Connection refused",
            "probe 500": f"--server {url}: a one-token completion of 'stub' failed: HTTP 500 (injected 500)",
            "probe too slow": f"--server {url}: a one-token completion of 'stub' failed: timed out",
            "not a URL": "--server: 'localhost:8000' is not an http(s) URL"}[case]
    assert err[0] == f"error: {want}"
    assert not list(tmp_path.iterdir())


def _answered(partial) -> set[int]:
    """Rows a run killed in ``partial`` had answered: in its journals and written shards."""
    rows = set()
    for p in partial.glob("rows-*.jsonl"):
        for line in p.read_text().splitlines():
            try:
                rows.add(json.loads(line)["row"])
            except ValueError:
                pass
    for p in partial.glob("shard-*.npz"):
        try:
            rows |= set(np.load(p)["order"].tolist())
        except (OSError, ValueError, KeyError):     # written at this moment
            pass
    return rows


def test_a_killed_prepare_resumes_by_row_id_asking_only_for_rows_missing(chat, tmp_path):
    """Sampled (a seed per row), two per prompt, killed mid-run: the rerun asks only for
    the rows not answered before the kill, and ends with the clean run's dataset."""
    target, prompts = chat
    base = hashed_model(EOS, range(4, 256))

    def slow(*a):
        time.sleep(0.15)
        return base(*a)
    sampling = ["--temperature", "0.8", "--samples-per-prompt", "2", "--seed", "0"]
    with stub_of(chat, generate=slow) as stub:
        cmd = [sys.executable, str(ROOT / "launch.py"), "prepare", "--target", str(target), "--prompts", str(prompts),
               "--out", str(tmp_path / "killed"), "--server", stub.url, "--max-new-tokens", "12", "--shard-size", "3",
               "--concurrency", "2", "--threads", "1", *sampling]
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        partial = tmp_path / "killed.partial"
        deadline = time.monotonic() + 120
        while len(_answered(partial)) < 5 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        answered = _answered(partial)
        assert 5 <= len(answered) < 2 * len(PROMPTS), "the kill must land mid-run"
        unwritten = next(s for s in range(6) if not (partial / f"shard-{s:05d}.npz").is_file())
        with open(partial / f"rows-{unwritten:05d}.jsonl", "a") as f:
            f.write('{"row": 1, "ids": [5, ')          # a line the kill cut short
        before = len(stub.row_requests())
        assert main(cmd[3:]) == 0
        assert all(r["top_k"] == 50 and r["temperature"] == 0.8 for r in stub.row_requests())
        rerun = {r["seed"] for r in stub.row_requests()[before:]}       # seed = row id with --seed 0
        assert rerun and not rerun & answered and rerun | answered == set(range(2 * len(PROMPTS)))
        clean = run(chat, tmp_path / "clean", stub.url, samples_per_prompt=2,
                    sampling=SamplingSettings(temperature=0.8, max_new_tokens=12))
    assert rows_of(tmp_path / "killed") == rows_of(clean) and not partial.exists()
    got = completions(clean)
    assert all(got[2 * p] != got[2 * p + 1] for p in range(len(PROMPTS)))      # each row its own seed
    assert read_metadata(clean)["samples_per_prompt"] == 2 and read_metadata(clean)["completions"] == 16


def test_rows_that_re_tokenize_unlike_the_server_are_counted_and_refused_past_the_limit(chat, tmp_path):
    base = hashed_model(EOS, range(4, 256), mean_len=4)

    def with_special(prompt, *a):         # every other row has a special token, which text drops
        ids = base(prompt, *a)
        return [3, *ids][:a[0]] if sum(prompt) % 2 else ids
    with stub_of(chat, strict=True, generate=with_special) as stub:
        with pytest.raises(DatasetRefused, match=r"--max-retokenize-mismatch: \d+ of 8 rows .* disagree .*count: "):
            run(chat, tmp_path / "ds", stub.url, server={"max_retokenize_mismatch": 0.2})
        assert (tmp_path / "ds.partial").is_dir() and not (tmp_path / "ds").exists()
        n = len(stub.row_requests())
        out = run(chat, tmp_path / "ds", stub.url, server={"max_retokenize_mismatch": 1.0})
        asked = stub.row_requests()[n:]
    engine = read_metadata(out)["engine"]
    tok = load_tokenizer(chat[0])
    bad = [i for i, p in enumerate(PROMPTS)
           if sum(tok(render_prompt(tok, p["messages"], TemplateSettings()))["input_ids"]) % 2]
    assert engine["retokenize_mismatch_rows"] == bad and engine["mismatch_reasons"] == {"count": len(bad)}
    assert 0 < len(bad) < len(PROMPTS) and len(asked) < len(PROMPTS)       # rows done before were kept


def test_several_servers_share_the_rows(chat, tmp_path):
    base = hashed_model(EOS, range(4, 256))

    def slow(*a):           # so that neither worker takes every row before the other starts
        time.sleep(0.05)
        return base(*a)
    with stub_of(chat, generate=slow) as a, stub_of(chat, generate=slow) as b:
        out = run(chat, tmp_path / "two", a.url, b.url, server={"concurrency": 1})
        assert a.row_requests() and b.row_requests()
        assert len(a.row_requests()) + len(b.row_requests()) == len(PROMPTS)
        one = run(chat, tmp_path / "one", a.url)
    assert rows_of(out) == rows_of(one) and read_metadata(out)["engine"]["servers"] == [a.url, b.url]


def test_samples_per_prompt_in_process_and_its_refusals(chat, tmp_path, capsys):
    target, prompts = chat
    out = prepare(str(target), prompts, tmp_path / "ds", sampling=SamplingSettings(temperature=0.8, max_new_tokens=10),
                  samples_per_prompt=2, limit=3, batch_size=4, shard_size=4, progress=False, threads=1)
    rows = rows_of(out)
    assert len(rows) == 6 and read_metadata(out)["samples_per_prompt"] == 2
    pairs = [(rows[2 * p], rows[2 * p + 1]) for p in range(3)]
    assert all(a[:ma.index(1)] == b[:mb.index(1)] for (a, ma), (b, mb) in pairs)      # the same prompt
    assert any(a != b for (a, _), (b, _) in pairs)     # sampled apart (the tiny model is peaked: not always)
    with pytest.raises(PrepareError, match="--samples-per-prompt 2 needs --temperature > 0"):
        prepare(str(target), prompts, tmp_path / "greedy", samples_per_prompt=2, progress=False)
    with pytest.raises(PrepareError, match="--dtype bfloat16: the in-process engine's"):
        run(chat, tmp_path / "dtype", "http://127.0.0.1:1", sampling=SamplingSettings(dtype="bfloat16"))
    assert main(["--target", str(target), "--prompts", str(prompts), "--out", str(tmp_path / "x"),
                 "--concurrency", "4"]) == 2
    capsys.readouterr()
    # The in-process engine's options mean nothing to a server: refused, not ignored.
    for flag, value in (("--batch-size", "8"), ("--device", "cpu")):
        assert main(["--target", str(target), "--prompts", str(prompts), "--out", str(tmp_path / "y"),
                     "--server", "http://127.0.0.1:1", flag, value]) == 2
        assert capsys.readouterr().err.strip() == (f"error: {flag} applies to the target loaded here, which "
                                                   "--server does not load (the server's own settings decide; "
                                                   "--concurrency sets requests in flight)")
        assert not (tmp_path / "y").exists()


def test_check_measures_agreement_with_the_in_process_text(chat, tmp_path, capsys):
    target, prompts = chat
    argv = ["--target", str(target), "--prompts", str(prompts), "--check", "4", "--max-new-tokens", "10",
            "--batch-size", "1", "--threads", "1"]
    with stub_of(chat, generate=tiny_model(target)) as same, stub_of(chat) as other:
        assert main([*argv, "--server", same.url]) == 0
        agree = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert main([*argv, "--server", other.url]) == 0
        differ = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert agree["exact_match"] == agree["text_exact_match"] == 1.0 and agree["prompts"] == 4
    assert agree["mean_agreed_prefix"] == agree["mean_inprocess_tokens"] > 0 and agree["path"] == "token_ids"
    assert differ["exact_match"] == 0.0 and differ["mean_agreed_prefix"] < 1
    assert not list(tmp_path.iterdir())


def test_agreement_counts_identical_rows_and_the_prefix_they_share():
    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(65 + i) for i in ids if not (skip_special_tokens and i == 0))
    got = agreement([[1, 2, 3], [1, 2, 4], [0, 5], [7]], [[1, 2, 3], [1, 2, 3, 9], [5], [8, 7]], Chars())
    assert got == {"prompts": 4, "exact_match": 0.25, "text_exact_match": 0.5, "mean_agreed_prefix": 5 / 4,
                   "mean_inprocess_tokens": 2.5, "mean_server_tokens": 2.25}
