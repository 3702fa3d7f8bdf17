"""A tensor-parallel target gang against a single target actor, as a user sees them.

    python -m benchmarks.bench_gang [--kills 5] [--skip-smollm]

1. Start-up and restart, for the tiny demo target and (when installed) SmolLM2-135M,
   at 1-1 and at 1x2-1 (``topology.target_tp`` 2): seconds from launching the job to
   the first optimizer step and to target.0's first Ready (``events.log``), then
   target.0 killed ``--kills`` times with SIGKILL by a pid from ``status.json`` (rank
   0, and for the gang rank 1 as often): seconds from the kill to the gang's Ready.
   Each gang twice: its ranks slicing their shards from the job's shared copy of the
   weights (``target.share_weights: on``, key ``tpK``) and reading them from the
   checkpoint at every start (``off``, key ``tpK_disk``).
   SmolLM2 has 9 attention heads and 3 key-value heads, so it splits 3 ways, not 2
   (``--smollm-tp``): its gang is three processes on this machine's two cores.
2. The tiny target's 1x2-1 run against the 1-1 reference: the largest relative
   differences of the losses and the final weights.
3. Features and forward speed of the tiny target split 2 ways and SmolLM2 split
   ``--smollm-tp`` ways, against whole: the largest difference between the ranks and
   against the unsplit model (relative to the largest activation), and target
   tokens/s on one batch of ``--tokens`` tokens: whole on one thread, whole on two
   threads, and split over ranks of one thread each.
One JSON line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.bench_startup import LONG, Launched, read_json, stats
from benchmarks.harness import ROOT, events, say
from dflash_actors.runtime.children import free_port


def kill_rank(job: Launched, rank: int) -> float:
    """SIGKILL rank ``rank`` of target.0 (pids from status.json); seconds to the gang's Ready."""
    end = time.monotonic() + 300
    while True:
        a = (read_json(job.run_dir / "status.json") or {}).get("actors", {}).get("target.0") or {}
        ranks = a.get("ranks") or [a.get("pid")]
        if a.get("state") in ("idle", "working") and None not in ranks and not set(ranks) & job.killed:
            break
        if time.monotonic() > end or job.proc.poll() is not None:
            raise RuntimeError("target.0 never ready")
        time.sleep(0.05)
    os.kill(ranks[rank], signal.SIGKILL)
    t_kill = time.monotonic()
    job.killed.update(ranks)
    while time.monotonic() < t_kill + 300:
        for e in events(job.run_dir):
            if e["event"] == "ready" and e.get("actor") == "target.0" and e["mono"] > t_kill:
                return round(e["mono"] - t_kill, 3)
        time.sleep(0.02)
    raise TimeoutError("target.0 did not come back")


def startup(name: str, args: list[str], sets: list[str], tp: int, kills: int, tmp: Path, share: str = "on") -> dict:
    topo = f"1x{tp}-1" if tp > 1 else "1-1"
    say(f"{name} {topo} share_weights {share}")
    job = Launched(tmp / f"{name}-{tp}-{share}", [*args, "--topology", topo],
                   [*sets, *LONG, f"target.share_weights={share}"])
    try:
        out = {"first_step_s": job.wait_first_step(1200)}
        first = next(e for e in events(job.run_dir) if e["event"] == "ready" and e.get("actor") == "target.0")
        out["target_ready_s"] = first["startup_s"]
        for rank in range(tp):
            times = []
            for _ in range(kills):
                times.append(kill_rank(job, rank))
                time.sleep(0.3)
            out[f"restart_rank{rank}_s"] = stats(times)
            say(f"{name} {topo} rank {rank} restarts: {out[f'restart_rank{rank}_s']}")
        return out
    finally:
        job.stop()


def _rank_forward(rank, world, port, path, layer_ids, ids, threads, reps, out):
    import torch

    from dflash_actors.models import tensor_parallel
    from dflash_actors.models.target import TargetModel
    torch.set_num_threads(threads)
    if world > 1:
        tensor_parallel.join(f"tcp://127.0.0.1:{port}", rank, world, torch.device("cpu"), 300)
        model = TargetModel(tensor_parallel.load_shard(path, torch.float32, world, torch.device("cpu")), layer_ids)
    else:
        from transformers import AutoModelForCausalLM
        model = TargetModel(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), layer_ids)
    model.hidden(ids[:, :16])       # warm-up
    t = time.perf_counter()
    for _ in range(reps):
        h = model.hidden(ids)
    out[rank] = (h, (time.perf_counter() - t) / reps)


def forward(path: str, layer_ids: list[int], world: int, threads: int, tokens: int, reps: int) -> tuple:
    """(rank 0's features, rank 1's or None, seconds per forward) of one [4, tokens/4] batch."""
    import torch
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    ids = torch.randint(0, vocab, (4, tokens // 4), generator=torch.Generator().manual_seed(0))
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Manager().dict()
    port = free_port()
    procs = [ctx.Process(target=_rank_forward, args=(r, world, port, path, layer_ids, ids, threads, reps, out))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(1200)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return out[0][0], [out[r][0] for r in range(1, world)], out[0][1]


def features(cfg, tokens: int, reps: int, tp: int) -> dict:
    """``cfg``'s target whole on one thread, on two, and split over ``tp`` ranks."""
    from dflash_actors.models.head import target_info
    from dflash_actors.models.target import ensure_target

    path = str(ensure_target(cfg))
    layer_ids = target_info(cfg).layer_ids
    say(f"forwards: whole on 1 thread, whole on 2, split over {tp} ranks")
    whole, _, t1 = forward(path, layer_ids, 1, 1, tokens, reps)
    _, _, t2 = forward(path, layer_ids, 1, 2, tokens, reps)
    r0, others, t_tp = forward(path, layer_ids, tp, 1, tokens, reps)
    scale = float(whole.abs().max())
    return {"tp": tp, "tokens": tokens, "layers": layer_ids,
            "rank_max_diff": max(float((r0 - r).abs().max()) for r in others),
            "vs_unsplit_rel": float((r0 - whole).abs().max()) / scale,
            "tokens_per_s": {"whole_1_thread": round(tokens / t1, 1), "whole_2_threads": round(tokens / t2, 1),
                             f"tp{tp}_1_thread_each": round(tokens / t_tp, 1)}}


def equivalence(tmp: Path) -> dict:
    """The tiny target's 1x2-1 run against the single-process reference of 1-1 (the
    pipeline's bits at target_tp 1): largest relative differences of the losses and of
    the final weights (each tensor against its largest entry)."""
    from dflash_actors.job.job import Job
    from dflash_actors.job.reference import train_reference
    from tests.support.pipeline import final_weights, losses, small_config

    say("tiny 1x2-1 against the 1-1 reference")
    cfg = small_config(ROOT / ".cache", tmp / "equiv", "1x2-1", "train.epochs=3")
    with contextlib.redirect_stdout(sys.stderr):     # the job's summary line: stdout holds the record only
        result = Job(cfg, progress=False).run()
    if result.exit_code:
        raise RuntimeError(result.reason)
    ref = train_reference(cfg.updated({"topology.target_tp": 1}), progress=False)
    got = final_weights(tmp / "equiv")
    w = max(float((got[k] - v).abs().max()) / max(float(v.abs().max()), 1e-12)
            for k, v in ref.state_dict.items() if not k.startswith("rotary_emb."))
    lo = max(abs(a - b) / abs(b) for a, b in zip(losses(tmp / "equiv"), ref.losses))
    return {"steps": len(ref.losses), "loss_rel_max": lo, "weights_rel_max": w}


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-smollm", action="store_true")
    ap.add_argument("--smollm-tp", type=int, default=3, help="SmolLM2's split (a divisor of 3 heads per kv group)")
    args = ap.parse_args(argv)
    out: dict = {"bench": "gang", "kills": args.kills}
    smollm = not args.skip_smollm and harness.smollm2_missing() is None
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        from dflash_actors.config import load_config
        out["tiny"] = {f"tp{tp}": startup("tiny", [], [], tp, args.kills, tmp) for tp in (1, 2)}
        out["tiny"]["tp2_disk"] = startup("tiny", [], [], 2, args.kills, tmp, "off")
        out["tiny"]["equivalence"] = equivalence(tmp)
        out["tiny"]["features"] = features(load_config(ROOT / "configs" / "default.yaml"), args.tokens, args.reps, 2)
        if smollm:
            sm = ["--config", "configs/smollm2-135m.yaml"]
            # The config's feature cache is refused with a gang: off for both, so both run the target.
            sets = ["eval.every=0", "target.feature_cache=off"]
            out["smollm2"] = {f"tp{tp}": startup("smollm2", sm, sets, tp, max(1, args.kills // 2), tmp)
                              for tp in (1, args.smollm_tp)}
            out["smollm2"][f"tp{args.smollm_tp}_disk"] = startup("smollm2", sm, sets, args.smollm_tp,
                                                                 max(1, args.kills // 2), tmp, "off")
            out["smollm2"]["features"] = features(load_config(ROOT / "configs" / "smollm2-135m.yaml"), args.tokens,
                                                  args.reps, args.smollm_tp)
        else:
            out["smollm2"] = {"skipped": "needs SmolLM2 (make smollm)"}
    harness.emit(out, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
