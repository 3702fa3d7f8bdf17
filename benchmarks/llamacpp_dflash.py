"""A trained drafter in llama.cpp's own DFlash speculative decoding, against ``evaluate``.

    python -m benchmarks.llamacpp_dflash --build .cache/llama.cpp/build --run runs/smollm2-dflash2 \\
        [--target .cache/SmolLM2-...-hf-...] [--prompts dflash_actors/prompts/heldout.jsonl] [--limit 32] \\
        [--eval-json .cache/eval-smollm2-dflash2.json]

What it does, for the run's newest checkpoint (DFlash or DFlash2, ``drafter.arch``):

1. converts the target's HF directory (f32, unquantized) and the checkpoint with llama.cpp's
   own ``convert_hf_to_gguf.py`` (the drafter with ``--target-model-dir``; the vendored
   ``gguf-py`` first on ``PYTHONPATH``), once: cached under ``--cache`` by path, size and mtime;
2. starts ``llama-server`` on 127.0.0.1 (one slot, ``--spec-type draft-dflash``, draft length
   ``block_size - 1``, ``p_min`` 0, ``LLAMA_TRACE=1`` so every verify step is logged) and sends
   the first ``--limit`` held-out prompts as token ids, templated exactly as ``evaluate`` templates
   them, one request at a time, greedy (temperature 0, top-k 1), each with a timeout; the server
   is always stopped, its process group killed if it does not exit;
3. compares the text with the target's greedy text in torch (``TargetTexts``, the ``references``
   evaluate checks losslessness against), cut at ``--max-new-tokens`` and after the first stop id;
4. counts llama.cpp's acceptance from its per-step log (``accepted A/D draft tokens``) the way
   ``evaluate`` counts real tau: per prompt the mean of (accepted + 1) over the verify steps that
   start before ``max_new_tokens`` tokens exist (the first token comes from the prefill; the
   last step counted in full); ``n_predict`` is ``max_new_tokens + block_size`` so no draft in
   that range is shortened by the remaining budget. llama.cpp's own figure (its log's
   ``mean len``: 1 + accepted / verify steps over the whole request) is reported beside it;
5. reads ``evaluate``'s per-prompt real tau from ``--eval-json`` (``launch.py evaluate --json``
   with the same prompts and limit), or runs ``evaluate_real`` here without baselines.

Prints one JSON line: arch, prompts, text-equal prompts, llama.cpp's acceptance over those,
evaluate's real tau over the same prompts, per-slot conditional acceptance, the build (its
command and minutes, from ``<build>/llamacpp-build.json`` if the Makefile wrote it).
Not in ``make bench``; ``make llamacpp-check`` builds llama.cpp once and runs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchmarks import harness
from benchmarks.harness import ROOT, say
from dflash_actors.runtime.children import free_port

HELDOUT = ROOT / "dflash_actors" / "prompts" / "heldout.jsonl"
STEP_RE = re.compile(r"task (\d+) \| accepted\s+(\d+)/\s*(\d+) draft tokens")
DONE_RE = re.compile(r"task (\d+) \|\s+total time =")


def source_dir(build: Path) -> Path:
    """The llama.cpp source tree a CMake build directory was configured from."""
    cache = build / "CMakeCache.txt"
    if cache.is_file():
        for line in cache.read_text(errors="replace").splitlines():
            if line.startswith("CMAKE_HOME_DIRECTORY:"):
                return Path(line.split("=", 1)[1])
    raise SystemExit(f"error: {build} has no CMakeCache.txt naming its source (pass --src)")


def file_key(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        for f in sorted(p.glob("*")) if p.is_dir() else [p]:
            if f.is_file() and f.suffix in (".json", ".safetensors", ".py", ""):
                st = f.stat()
                h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:12]


def convert(src: Path, model_dir: Path, out: Path, target_dir: Path | None, timeout: int) -> float:
    """llama.cpp's converter on ``model_dir`` to an f32 GGUF ``out`` (skipped when cached);
    returns the seconds it took (0 when cached)."""
    if out.is_file():
        return 0.0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.gguf")
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "f32",
           "--outfile", str(tmp)]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), str(src)]),
           "NO_LOCAL_GGUF": ""}
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"convert_hf_to_gguf.py {model_dir} failed (exit {r.returncode}): {tail}")
    tmp.replace(out)
    return time.perf_counter() - t


class Server:
    """``llama-server`` with the drafter, in a session of its own; a context manager that
    always stops it."""

    def __init__(self, binary: Path, target: Path, drafter: Path, n_draft: int, threads: int, log: Path,
                 ctx: int = 2048, start_timeout: float = 300, extra: tuple[str, ...] = ()):
        self.log_path, self.port = log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(binary), "-m", str(target), "-md", str(drafter), "--spec-type", "draft-dflash",
                    "--spec-draft-n-max", str(n_draft), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
                    "-np", "1", "-c", str(ctx), "-t", str(threads), "-tb", str(threads),
                    "-td", str(threads), "-tbd", str(threads), "--host", "127.0.0.1", "--port", str(self.port),
                    "-lv", "3", "--no-warmup", *extra]
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        t = time.perf_counter()
        self._f = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._f, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "LLAMA_TRACE": "1"})
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.start_s = time.perf_counter() - t
                        return self
            except (OSError, urllib.error.HTTPError):
                pass
            if self.proc.poll() is not None or time.perf_counter() - t > self.start_timeout:
                tail = self.log_text()[-1500:]
                self.__exit__(None, None, None)
                raise RuntimeError(f"llama-server did not come up (exit {self.proc.returncode}): {tail}")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            except ProcessLookupError:
                pass
        self._f.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def complete(self, ids: list[int], n_predict: int, timeout: float) -> tuple[dict, list[tuple[int, int]]]:
        """One greedy /completion from token ids; returns the answer and its verify steps
        ``[(accepted, drafted), ...]`` from the log, in order."""
        body = {"prompt": ids, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "seed": 0,
                "cache_prompt": False, "return_tokens": True, "stream": False, "id_slot": 0}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            ans = json.loads(r.read())
        # The server logs asynchronously: wait until this task's closing lines are written.
        deadline = time.perf_counter() + 10
        while True:
            text = self.log_text()
            done = [int(m.group(1)) for m in DONE_RE.finditer(text)]
            if done and (self._last_task is None or done[-1] > self._last_task) or time.perf_counter() > deadline:
                break
            time.sleep(0.1)
        task = done[-1] if done else -1
        self._last_task = task
        steps = [(int(m.group(2)), int(m.group(3))) for m in STEP_RE.finditer(text) if int(m.group(1)) == task]
        return ans, steps

    _last_task: int | None = None


def eval_counting(steps: list[tuple[int, int]], generated: list[int], max_new: int,
                  stop_ids: tuple[int, ...]) -> list[int]:
    """The accepted drafts of the verify steps ``evaluate`` would count: while fewer than
    ``max_new + 1`` tokens exist and no stop token was produced (the prefill makes the first)."""
    out, g = [], 1
    stops = set(stop_ids)
    for a, _ in steps:
        if g > max_new or stops & set(generated[:g]):
            break
        out.append(a)
        g += a + 1
    return out


def body(ids: list[int], max_new: int, stop_ids: tuple[int, ...]) -> tuple[list[int], bool]:
    """Generated ids cut at ``max_new`` and before the first stop id, and whether one came."""
    ids = list(ids)[:max_new]
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[:i], True
    return ids, False


def conditional(accepted: list[int], slots: int) -> list[float | None]:
    from dflash_actors.eval.decode import conditional_acceptance

    return [None if x is None else round(float(x), 4) for x in conditional_acceptance(accepted, slots)]


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--build", required=True, help="llama.cpp CMake build directory (bin/llama-server)")
    ap.add_argument("--src", help="llama.cpp source tree (default: the build's CMAKE_HOME_DIRECTORY)")
    ap.add_argument("--run", required=True, help="run directory (its newest checkpoint), or a checkpoint")
    ap.add_argument("--target", help="target HF directory (default: the run's target.path, resolved)")
    ap.add_argument("--prompts", default=str(HELDOUT))
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--eval-json", help="launch.py evaluate --json of this run, same prompts and limit")
    ap.add_argument("--eval-wait", type=float, default=0, help="seconds to wait for --eval-json to appear")
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "llamacpp-gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--convert-timeout", type=int, default=1800)
    ap.add_argument("--server-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    args = ap.parse_args(argv)

    import torch

    from dflash_actors.eval.parity import chat_prompts, load_parity_target, resolve_drafter_dir, saved_run_config
    from dflash_actors.eval.tau import TargetTexts
    from dflash_actors.models.drafter import DFlashDrafter, is_dflash2
    from dflash_actors.models.target_dir import resolve_target_dir
    from dflash_actors.prepare.generate import stop_ids as get_stop_ids
    from dflash_actors.prepare.regenerate import load_tokenizer

    build = Path(args.build).resolve()
    binary = build / "bin" / "llama-server"
    if not binary.is_file():
        raise SystemExit(f"error: no llama-server in {build}/bin (build it first: make llamacpp-check)")
    src = Path(args.src).resolve() if args.src else source_dir(build)
    ckpt = resolve_drafter_dir(args.run)
    run_cfg = saved_run_config(ckpt) or {}
    target_dir = Path(args.target) if args.target else resolve_target_dir(run_cfg["target"]["path"])
    drafter = DFlashDrafter.from_pretrained(ckpt).eval()
    B, arch = drafter.block_size, "dflash2" if is_dflash2(drafter.config) else "dflash"

    cache = Path(args.cache)
    tgt_gguf = cache / f"target-{target_dir.name}-{file_key(target_dir)}-f32.gguf"
    dft_gguf = cache / f"drafter-{arch}-{ckpt.parent.parent.name}-{ckpt.name}-{file_key(ckpt, target_dir)}-f32.gguf"
    say(f"converting (cached in {cache})")
    conv_s = {"target": round(convert(src, target_dir, tgt_gguf, None, args.convert_timeout), 1),
              "drafter": round(convert(src, ckpt, dft_gguf, target_dir, args.convert_timeout), 1)}

    # The prompts as evaluate templates them and the stop ids it stops at.
    from transformers import GenerationConfig

    tok = load_tokenizer(target_dir)
    prompts = [p.tolist() for p in chat_prompts(tok, args.prompts, None, None, args.limit)[0]]
    stops = tuple(get_stop_ids(tok, SimpleNamespace(generation_config=GenerationConfig.from_pretrained(target_dir))))

    served = []
    with Server(binary, tgt_gguf, dft_gguf, B - 1, args.threads, cache / f"server-{arch}.log",
                extra=tuple(args.server_arg)) as srv:
        say(f"llama-server up in {srv.start_s:.0f} s")
        t = time.perf_counter()
        for ids in prompts:
            served.append(srv.complete(ids, args.max_new_tokens + B, args.request_timeout))
        serve_s = time.perf_counter() - t
    say(f"{len(prompts)} prompts through llama-server in {serve_s:.0f} s")

    # The target's greedy text in torch: what evaluate checks its decoding against.
    target, _ = load_parity_target(str(target_dir), drafter.target_layer_ids)
    t = time.perf_counter()
    with torch.no_grad():
        tt = TargetTexts.greedy(target, [torch.tensor(p) for p in prompts], args.max_new_tokens, B, stops)
    refs = [r[len(p):].tolist() for r, p in zip(tt.references, prompts)]
    say(f"target greedy text of {len(prompts)} prompts in {time.perf_counter() - t:.0f} s")
    del target

    if args.eval_json:
        f = Path(args.eval_json)
        deadline = time.time() + args.eval_wait
        while not f.is_file() and time.time() < deadline:
            time.sleep(10)
        rep = json.loads(f.read_text())
        if rep["num_prompts"] != len(prompts) or rep["max_new_tokens"] != args.max_new_tokens:
            raise SystemExit(f"error: {args.eval_json}: {rep['num_prompts']} prompts, {rep['max_new_tokens']} new "
                             f"tokens; this run compares {len(prompts)}, {args.max_new_tokens}")
    else:
        from dflash_actors.eval.parity import evaluate_real
        rep = evaluate_real(ckpt, args.prompts, target_path=str(target_dir), max_new_tokens=args.max_new_tokens,
                            limit=args.limit, baselines=(), log=say)
    ev = rep["results"]["trained"]["real"]
    ev_tau = ev["per_prompt"]

    rows = []
    for i, (ans, steps) in enumerate(served):
        mine, stopped = body(ans.get("tokens") or [], args.max_new_tokens, stops)
        if ans.get("stop_type") == "eos" and len(ans.get("tokens") or []) < args.max_new_tokens:
            stopped = True
        ref, ref_stopped = body(refs[i], args.max_new_tokens, stops)
        equal = mine == ref and stopped == ref_stopped
        gen = list(ans.get("tokens") or [])
        if stopped and not any(x in stops for x in gen):
            gen = gen + [stops[0]]
        acc = eval_counting(steps, gen, args.max_new_tokens, stops)
        tm = ans.get("timings") or {}
        first_diff = next((k for k, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))
        rows.append({"prompt": i, "equal": equal, "first_diff": None if equal else first_diff,
                     "tau": float(np.mean([a + 1 for a in acc])) if acc else None, "accepted": acc,
                     "own_mean_len": 1 + sum(a for a, _ in steps) / len(steps) if steps else None,
                     "log_matches_timings": (sum(a for a, _ in steps) == tm.get("draft_n_accepted", 0)
                                             and sum(d for _, d in steps) == tm.get("draft_n", 0)),
                     "draft_n": tm.get("draft_n", 0), "draft_n_accepted": tm.get("draft_n_accepted", 0)})

    eq = [r for r in rows if r["equal"] and r["tau"] is not None]
    info_f = build / "llamacpp-build.json"
    info = json.loads(info_f.read_text()) if info_f.is_file() else {}
    out = {
        "bench": "llamacpp_dflash", "arch": arch, "checkpoint": ckpt, "target": target_dir,
        "block_size": B, "draft_len": B - 1, "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
        "text_equal": len(eq), "text_differs_at": {r["prompt"]: r["first_diff"] for r in rows if not r["equal"]},
        "llamacpp_tau": round(float(np.mean([r["tau"] for r in eq])), 4) if eq else None,
        "evaluate_real_tau": round(float(np.mean([ev_tau[r["prompt"]] for r in eq])), 4) if eq else None,
        "llamacpp_own_mean_len": round(float(np.mean([r["own_mean_len"] for r in eq])), 4) if eq else None,
        "evaluate_real_tau_all": round(float(np.mean(ev_tau)), 4),
        "evaluate_lossless_prompts": ev.get("lossless_prompts"),
        "per_prompt_equal": {r["prompt"]: [round(r["tau"], 4), ev_tau[r["prompt"]]] for r in eq},
        "per_slot_llamacpp": conditional([a for r in eq for a in r["accepted"]], B - 1),
        "per_slot_evaluate_all_prompts": ev.get("per_position"),
        "draft_n": sum(r["draft_n"] for r in rows), "draft_n_accepted": sum(r["draft_n_accepted"] for r in rows),
        "log_matches_timings": all(r["log_matches_timings"] for r in rows),
        "tau_counting": "per prompt mean of (accepted+1) over verify steps starting before max_new_tokens tokens "
                        "exist, then mean over prompts (evaluate's); llamacpp_own_mean_len: 1 + accepted/steps "
                        "over the whole request (llama-server's log)",
        "convert_s": conv_s, "server_start_s": round(srv.start_s, 1), "serve_s": round(serve_s, 1),
        "threads": args.threads, "server_cmd": " ".join(srv.cmd[1:]),
        "build_command": info.get("command"), "build_minutes": info.get("minutes"),
        "llama_cpp": info.get("version") or str(src),
    }
    harness.emit(out, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
