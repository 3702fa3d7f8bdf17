"""Start-up and restart, with each actor start method side by side, as a user sees them.

    python -m benchmarks.bench_startup [--kills 10] [--big-kills 3] [--skip-smollm] [--skip-big]

1. The demo at 2-2 (``launch.py --topology 2-2``, the tiny target), once per
   ``runtime.start_method``: seconds from launching the process to the first optimizer
   step (``metrics.jsonl``'s step 1); then each role killed ``--kills`` times with
   SIGKILL, by its pid from ``status.json``, and the time from the kill to its
   successor's Ready (``events.log``, the same monotonic clock), split into detection
   (kill to the supervisor's ``died``), respawn (``died`` to ``spawn``) and start-up
   (``spawn`` to Ready: interpreter or fork, imports, model build): ``split_s``, medians
   over every role.
2. SmolLM2-135M at 1-1 (when installed and its data prepared): launch to first step.
3. A target of at least 1 GB (a random-initialised Qwen3 shape, fp32, saved once under
   ``.cache``): ``target.0`` killed ``--big-kills`` times with ``target.share_weights``
   on and off (the new start method): kill to Ready. Off, twice: "disk" with the
   checkpoint's pages dropped from the page cache before each kill (``evict``: the read
   is from the disk), and "disk_warm" from the page cache the machine kept.
One JSON line; "fast" is the default start method (forkserver).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import ROOT, events, say

ROLES = ("loader.0", "target.0", "drafter.0", "optimizer.0")
BIG = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 16,
       "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000, "tie_word_embeddings": False}
"""About 0.28 billion parameters: 1.1 GB in fp32 (what a CPU target computes in)."""


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def first_step_time(run_dir: Path):
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "step":
                return rec["time"]
    except (OSError, ValueError):
        pass
    return None


def mapped(pid: int) -> bool:
    """Whether process ``pid`` still maps memory (a killed one is a zombie without any)."""
    try:
        return bool(Path(f"/proc/{pid}/maps").read_text())
    except OSError:
        return False


class Launched:
    """``launch.py`` in a subprocess, watched through its run directory."""

    def __init__(self, run_dir: Path, args: list[str], sets: list[str]):
        self.run_dir = run_dir
        cmd = [sys.executable, "launch.py", *args, "--run-dir", str(run_dir)]
        for s in sets:
            cmd += ["--set", s]
        self.killed: set[int] = set()
        self.splits: list[dict] = []      # per kill: detection, respawn and start-up seconds
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait_first_step(self, timeout: float) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            t = first_step_time(self.run_dir)
            if t is not None:
                return round(t - self.t0, 2)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended before its first step: {self.proc.stderr.read()[-1500:]}")
            time.sleep(0.05)
        raise TimeoutError("no first step")

    def ready_pid(self, actor: str, timeout: float = 300) -> int:
        """The pid status.json gives for a ready ``actor``; not one killed before (the
        file is rewritten about once a second, so it can still name the victim)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = read_json(self.run_dir / "status.json") or {}
            a = st.get("actors", {}).get(actor)
            if a and a.get("pid") and a.get("state") in ("idle", "working") and a.get("phase") is None \
                    and a["pid"] not in self.killed:
                return a["pid"]
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended: {self.proc.stderr.read()[-1500:]}")
            time.sleep(0.05)
        raise TimeoutError(f"{actor} never ready")

    def restart_s(self, actor: str, after_kill=None) -> float:
        """SIGKILL ``actor`` by its pid from status.json; seconds until its successor is
        Ready. ``after_kill()`` runs once the victim is gone (its mappings with it)."""
        pid = self.ready_pid(actor)
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        self.killed.add(pid)
        if after_kill is not None:
            while mapped(pid):
                time.sleep(0.001)
            after_kill()
        end = t_kill + 300
        while time.monotonic() < end:
            mine = [e for e in events(self.run_dir) if e.get("actor") == actor and e["mono"] > t_kill]
            ready = next((e for e in mine if e["event"] == "ready"), None)
            if ready is not None:
                self.splits.append(split(mine, t_kill))
                return round(ready["mono"] - t_kill, 3)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended: {self.proc.stderr.read()[-1500:]}")
            time.sleep(0.02)
        raise TimeoutError(f"{actor} did not come back")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def split(mine: list[dict], t_kill: float) -> dict:
    """One restart's seconds from an actor's events after its kill: to ``died`` (the
    supervisor saw it), from there to ``spawn``, and the replacement's own ``startup_s``."""
    first = {}
    for e in mine:
        first.setdefault(e["event"], e)
    died, spawn, ready = first.get("died"), first.get("spawn"), first.get("ready")
    return {"detect": round(died["mono"] - t_kill, 3) if died else None,
            "respawn": round(spawn["mono"] - died["mono"], 3) if died and spawn else None,
            "startup": ready.get("startup_s") if ready else None}


def split_medians(splits: list[dict]) -> dict:
    return {k: round(statistics.median(v), 3) if (v := [s[k] for s in splits if s[k] is not None]) else None
            for k in ("detect", "respawn", "startup")}


def stats(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 3), "max": round(max(xs), 3), "n": len(xs)} if xs else {}


LONG = ["train.epochs=400", "runtime.max_restarts=100000", "eval.every=0"]
"""Long enough to kill every role many times; restarts never exhaust the limit."""


def demo(method: str, kills: int, tmp: Path) -> dict:
    say(f"demo 2-2, start_method {method}")
    job = Launched(tmp / f"demo-{method}", ["--topology", "2-2"], [f"runtime.start_method={method}", *LONG])
    try:
        out = {"first_step_s": job.wait_first_step(600), "restart_s": {}, "all": []}
        for role in ROLES:
            times = []
            for _ in range(kills):
                times.append(job.restart_s(role))
                time.sleep(0.3)     # let the successor take work before the next kill
            out["restart_s"][role] = stats(times)
            out["all"] += times
            say(f"{method} {role}: {out['restart_s'][role]}")
        out["split_s"] = split_medians(job.splits)
        return out
    finally:
        job.stop()


def smollm(method: str, tmp: Path) -> dict | None:
    say(f"SmolLM2 1-1, start_method {method}")
    job = Launched(tmp / f"smollm-{method}", ["--config", "configs/smollm2-135m.yaml", "--topology", "1-1"],
                   [f"runtime.start_method={method}", "eval.every=0"])
    try:
        return {"first_step_s": job.wait_first_step(1200)}
    finally:
        job.stop()


def big_target() -> tuple[Path, int]:
    """The ~1.1 GB random Qwen3 checkpoint, made once under .cache."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = ROOT / ".cache" / "bench-qwen3-1g"
    if not (out / "config.json").is_file():
        say(f"building {out}")
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**BIG))
        model.config.architectures = ["Qwen3ForCausalLM"]
        model.save_pretrained(out)
    from dflash_actors.models.shared_weights import weight_bytes
    return out, weight_bytes(out, torch.float32)


WEIGHT_PHASES = ("load target weights", "map shared weights", "copy shared weights to device")


def phase_seconds(run_dir: Path, actor: str) -> list[dict]:
    """Per start of ``actor`` after the first: seconds in its weights phase and in its
    self-check (from ``starting`` events to the next one, and to Ready; 0 when it had none)."""
    out, cur = [], None
    for e in events(run_dir):
        if e.get("actor") != actor:
            continue
        if e["event"] == "starting" and e.get("phase") in WEIGHT_PHASES:
            cur = {"weights_at": e["mono"]}
        elif e["event"] == "starting" and e.get("phase") == "self-check features" and cur:
            cur["check_at"] = e["mono"]
        elif e["event"] == "ready" and cur:
            # No check (a CPU restart on shared weights): the weights phase ends at Ready.
            check_at = cur.get("check_at", e["mono"])
            out.append({"weights_s": round(check_at - cur["weights_at"], 3),
                        "self_check_s": round(e["mono"] - check_at, 3)})
            cur = None
    return out[1:]


def evict(path: Path) -> None:
    """Drop the checkpoint's pages from the page cache, so that the next read is from disk."""
    for f in path.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def big_restarts(path: Path, share: str, kills: int, tmp: Path, cold: bool = False) -> tuple[list[float], list[dict]]:
    """``target.0`` killed ``kills`` times; with ``cold``, the checkpoint evicted from the
    page cache as soon as the victim is gone (pages a live process maps cannot be): the
    read a restart pays when the machine has not kept the checkpoint."""
    name = f"{share}{'-cold' if cold else ''}"
    say(f"1 GB target restarts, share_weights {name}")
    job = Launched(tmp / f"big-{name}", ["--topology", "1-1"],
                   [f"target.path={path}", f"target.share_weights={share}", "drafter.target_layer_ids=[1, 8, 13]",
                    "batching.token_budget=512", *LONG])
    try:
        job.wait_first_step(900)
        times = []
        for _ in range(kills):
            times.append(job.restart_s("target.0", (lambda: evict(path)) if cold else None))
            time.sleep(0.3)
        return times, phase_seconds(job.run_dir, "target.0")
    finally:
        job.stop()


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--kills", type=int, default=10, help="kills per role in the demo")
    ap.add_argument("--big-kills", type=int, default=3)
    ap.add_argument("--skip-smollm", action="store_true")
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--only-big", action="store_true", help="only the large target's restarts")
    args = ap.parse_args(argv)
    out: dict = {"bench": "startup", "kills_per_role": args.kills}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.only_big:
            args.skip_smollm = True
        runs = {} if args.only_big else {m: demo(m, args.kills, tmp) for m in ("spawn", "forkserver")}
        allk = {m: runs[m].pop("all") for m in runs}
        out.update({} if args.only_big else {"demo": runs,
                    "spawn_first_step_s": runs["spawn"]["first_step_s"],
                    "fast_first_step_s": runs["forkserver"]["first_step_s"],
                    "spawn_restart_s_median": round(statistics.median(allk["spawn"]), 3),
                    "fast_restart_s_median": round(statistics.median(allk["forkserver"]), 3),
                    "fast_restart_s_max": max(allk["forkserver"]),
                    "fast_restart_split_s": runs["forkserver"]["split_s"]})
        have_smollm = harness.smollm2_missing() is None and \
            (ROOT / ".cache" / "smollm2-train" / "prepare.json").is_file()
        if have_smollm and not args.skip_smollm:
            out["smollm2_1_1"] = {m: smollm(m, tmp) for m in ("spawn", "forkserver")}
        elif not args.skip_smollm:
            out["smollm2_1_1"] = "skipped: needs make smollm and python -m benchmarks.bench_real's prepared data"
        if not args.skip_big:
            path, nbytes = big_target()
            runs = {"off-cold": big_restarts(path, "off", args.big_kills, tmp, cold=True),
                    "off": big_restarts(path, "off", args.big_kills, tmp),
                    "on": big_restarts(path, "on", args.big_kills, tmp)}
            med = {k: round(statistics.median(times), 3) for k, (times, _) in runs.items()}
            out.update({"target_bytes": nbytes, "target_shape": f"Qwen3 {BIG}, random, float32",
                        "target_restart_disk_s": med["off-cold"], "target_restart_disk_warm_s": med["off"],
                        "target_restart_shared_s": med["on"],
                        "target_restarts": {k: times for k, (times, _) in runs.items()},
                        "target_restart_phases": {k: phases for k, (_, phases) in runs.items()}})
    harness.emit(out, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
