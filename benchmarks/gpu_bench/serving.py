"""``prepare --server`` against a real vLLM on this machine (skipped without vLLM).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .common import ROOT, emit, error_line, sig
from .launches import last_error


def bench_serving(work: Path, limit_s: float, out: str | None = None) -> dict:
    """``prepare --server`` against a real vLLM on this machine, when vLLM is installed
    (nothing is downloaded): the tiny chat target served on cuda:0, 16 prompts through
    the token-id path; records the path taken, rows and tokens/s. Skipped without vLLM."""
    import importlib.util
    import urllib.request

    result: dict = {"section": "serving"}
    if importlib.util.find_spec("vllm") is None:
        result["skipped"] = "vllm is not installed on this machine"
        emit(result, out)
        return result
    from dflash_actors.config import load_config
    from dflash_actors.models.target import ensure_target
    from tests.support.chat import tiny_chat_target

    work = Path("/tmp/gpu-serving")
    shutil.rmtree(work, ignore_errors=True)
    cfg = load_config(ROOT / "configs/default.yaml", [f"data.cache_dir={work / 'cache'}"])
    model = tiny_chat_target(ensure_target(cfg), work / "chat")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."}]}) + "\n"
                               for i in range(16)))
    port = 8000 + os.getpid() % 1000
    deadline = time.monotonic() + limit_s
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                               "--port", str(port), "--max-model-len", "512", "--gpu-memory-utilization", "0.3"],
                              stdout=open(work / "serving_vllm.log", "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        t0 = time.monotonic()
        while time.monotonic() < deadline - 30:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            if server.poll() is not None:
                raise RuntimeError(f"vLLM exited {server.returncode}: {last_error(work / 'serving_vllm.log')}")
            time.sleep(2)
        else:
            raise RuntimeError("vLLM did not answer /health in time")
        result["server_start_s"] = round(time.monotonic() - t0, 1)
        t1 = time.monotonic()
        cmd = [sys.executable, "launch.py", "prepare", "--target", str(model), "--prompts", str(prompts),
               "--out", str(work / "ds"), "--server", f"http://127.0.0.1:{port}", "--max-new-tokens", "32",
               "--concurrency", "16"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(10.0, deadline - time.monotonic()))
        (work / "serving_prepare.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode:
            raise RuntimeError(f"prepare --server exit {proc.returncode}: {last_error(work / 'serving_prepare.log')}")
        meta = json.loads((work / "ds" / "prepare.json").read_text())
        engine = meta.get("engine", {})
        result.update(path=engine.get("path"), rows=meta["completions"], generated_tokens=meta["generated_tokens"],
                      tokens_per_s=sig(meta["generated_tokens"] / (time.monotonic() - t1)),
                      token_exact=engine.get("path") == "token_ids")
    except Exception as e:  # noqa: BLE001 - recorded in the section's line
        result["error"] = error_line(e)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    emit(result, out)
    return result
