"""``make chaos``: one 2-2 job trained three times, clean and under two kinds of chaos,
compared bit for bit. Prints one JSON line.

1. clean: ``launch.py`` undisturbed; its final weights are the oracle.
2. external: ``launch.py chaos`` kills random actors with kill -9
   (``KILLS``), the supervisor itself (``SUPERVISOR_KILLS``, each followed by
   ``--resume``), and SIGSTOPs then SIGCONTs one healthy actor for half of
   ``hang_timeout_s`` (it must not be restarted). ``runtime.faults`` adds a kill
   in the middle of a checkpoint write and one in the middle of a weight publication.
3. internal: ``launch.py --chaos SEED``: random injected faults of every ending kind
   (kill, exit, exception, segfault, hang, slow) at every fault point of every actor.

For the chaotic runs: exit 0, final weights bit-identical to the clean run's, the
final checkpoint verifies and loads, its batch count equals the run's batch count
(each step checks that every drafter's sum holds exactly its batches), no process of
the run outlives it, and /dev/shm gains nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_actors.tools.chaos import restart_times

ROOT = Path(__file__).resolve().parents[1]
SEED = int(os.environ.get("CHAOS_SEED", "1"))
KILLS, SUPERVISOR_KILLS, STOPS, INTERNAL_FAULTS = 20, 5, 1, 12
# About 2 minutes of training here undisturbed (400 steps), long enough for every event
# to land while it runs: restarts now take a fraction of a second, so the chaos barely
# slows the run, and at 40 epochs (47 s) it ended before 14 of its 26 events
# (2026-12-03). Chaos restarts an actor far more often than a healthy cluster: the
# restart-intensity limit is raised so that it does not end the run.
JOB = ["--topology", "2-2", "--set", "data.synthetic.num_samples=128", "--set", "data.synthetic.heldout_samples=4",
       "--set", "train.epochs=100", "--set", "train.checkpoint_every=4", "--set", "runtime.heartbeat_s=0.2",
       "--set", "runtime.hang_timeout_s=10", "--set", "runtime.grace_s=5", "--set", "runtime.max_restarts=30",
       "--set", f"data.cache_dir={ROOT / '.cache'}"]
MID_WRITE = [{"actor": "optimizer.0", "at_batch": 60, "kind": "sigkill", "at": "checkpoint"},
             {"actor": "optimizer.0", "at_batch": 100, "kind": "sigkill", "at": "publish"}]


def progress(msg: str) -> None:
    print(f"# {msg}", flush=True)


def launch(run_dir: Path, *extra: str) -> tuple[int, float]:
    t = time.monotonic()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        code = subprocess.call([sys.executable, "launch.py", "--run-dir", str(run_dir), *JOB, *extra],
                               cwd=ROOT, stdout=log, stderr=log)
    return code, time.monotonic() - t


def final(run_dir: Path) -> tuple[dict, dict, list[str]]:
    """Final weights, trainer state, and what is wrong with the final checkpoint."""
    from dflash_actors.models.drafter import DFlashDrafter
    from dflash_actors.train.checkpoint import latest_checkpoint, load_trainer_state
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return {}, {}, ["no valid final checkpoint"]
    return DFlashDrafter.from_pretrained(ckpt).state_dict(), load_trainer_state(ckpt), []


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.log").read_text().splitlines()]


def orphans(run_dir: Path) -> list[int]:
    import psutil
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if str(run_dir) in " ".join(p.info["cmdline"] or ()) and p.pid != os.getpid():
            found.append(p.pid)
    return found


def judge(name: str, run_dir: Path, code: int, clean: dict, total_batches: int) -> dict:
    weights, state, problems = final(run_dir)
    if code != 0:
        problems.append(f"exit {code}")
    keys = [k for k in clean if not k.startswith("rotary_emb.")]
    identical = bool(weights) and all(k in weights and torch.equal(weights[k], clean[k]) for k in keys)
    applied = state.get("batches_applied")
    left = orphans(run_dir)
    if left:
        problems.append(f"orphan processes {left}")
    return {"run": name, "bit_identical": identical, "batches_applied": applied,
            "batches_lost": max(0, total_batches - applied) if applied is not None else None,
            "batches_duplicated": max(0, applied - total_batches) if applied is not None else None,
            "problems": problems}


def main() -> int:
    t_all = time.monotonic()
    shm_before = set(os.listdir("/dev/shm"))
    base = Path(tempfile.mkdtemp(prefix="chaos-", dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None))
    progress(f"runs under {base}")

    progress("clean run ...")
    code, clean_s = launch(base / "clean")
    clean_w, clean_state, problems = final(base / "clean")
    if code or problems:
        print(json.dumps({"error": f"the clean run failed (exit {code}) {problems}; see {base}/clean.log"}))
        return 1
    total = clean_state["next_batch"]
    progress(f"clean: {clean_s:.0f} s, {total} batches")

    progress(f"external chaos: {KILLS} actor kills, {SUPERVISOR_KILLS} supervisor kills, {STOPS} stop/cont ...")
    ext_dir = base / "external"
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "launch.py", "chaos", str(ext_dir), "--kills", str(KILLS),
                           "--supervisor-kills", str(SUPERVISOR_KILLS), "--stop-cont", str(STOPS),
                           "--seed", str(SEED), "--quiet", "--", *JOB, "--set",
                           "runtime.faults=" + json.dumps(MID_WRITE)],
                          cwd=ROOT, capture_output=True, text=True)
    ext_s = time.monotonic() - t
    driver = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {"problems": [proc.stderr]}
    ext = judge("external", ext_dir, driver.get("exit_code", -1), clean_w, total)
    ext["problems"] += driver["problems"]
    ext_ev = events(ext_dir)
    mid_write = [e for e in ext_ev if e["event"] == "fault"]
    progress(f"external: {ext_s:.0f} s, {driver}")

    progress(f"internal chaos: launch.py --chaos {SEED} ({INTERNAL_FAULTS} faults) ...")
    int_dir = base / "internal"
    code, int_s = launch(int_dir, "--chaos", str(SEED), "--chaos-faults", str(INTERNAL_FAULTS))
    internal = judge("internal", int_dir, code, clean_w, total)
    int_ev = events(int_dir)
    fired = [e for e in int_ev if e["event"] == "fault"]
    progress(f"internal: {int_s:.0f} s, {len(fired)} faults fired")

    restarts = restart_times(ext_dir) + restart_times(int_dir)
    injected = driver.get("kills", 0) + driver.get("supervisor_kills", 0) + len(mid_write) + len(fired)
    runs = [ext, internal]
    survived = injected if all(r["bit_identical"] and not r["problems"] for r in runs) else 0
    time.sleep(1.0)
    shm_new = sorted(set(os.listdir("/dev/shm")) - shm_before)
    record = {
        "bench": "chaos", "seed": SEED, "topology": "2-2", "batches": total,
        "faults_injected": injected, "faults_survived": survived,
        "actor_kills": driver.get("kills"), "supervisor_kills": driver.get("supervisor_kills"),
        "stop_cont": driver.get("stop_cont"), "mid_write_faults": len(mid_write), "internal_faults": len(fired),
        "batches_lost": sum(r["batches_lost"] or 0 for r in runs) if all(r["batches_lost"] is not None for r in runs)
        else None,
        "batches_duplicated": sum(r["batches_duplicated"] or 0 for r in runs)
        if all(r["batches_duplicated"] is not None for r in runs) else None,
        "bit_identical": all(r["bit_identical"] for r in runs),
        "restart_s_median": round(statistics.median(restarts), 2) if restarts else None,
        "restart_s_max": round(max(restarts), 2) if restarts else None,
        "supervisor_restart_s_median": driver.get("supervisor_restart_s_median"),
        "wall_over_clean": round(ext_s / clean_s, 2), "internal_wall_over_clean": round(int_s / clean_s, 2),
        "clean_s": round(clean_s, 1), "shm_residue": shm_new, "problems": ext["problems"] + internal["problems"],
        "suite_s": round(time.monotonic() - t_all, 1), "runs": str(base),
    }
    print(json.dumps(record), flush=True)
    ok = (record["bit_identical"] and not record["problems"] and not shm_new and record["batches_lost"] == 0
          and record["batches_duplicated"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
