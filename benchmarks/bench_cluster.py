"""The cross-node exchange on loopback, and the paper estimate of scaling out.

Two processes, each one node's ``cluster.Link`` over gloo on 127.0.0.1, run the exchange
of real steps (store barrier, stats all-gather, ordered gradient chain, broadcast) for
drafters of three sizes: the tiny test drafter (41,248 parameters), 4M and 32M. Each
step's time is from the optimizer's request to the summed gradient being there; a
plain gloo ``allreduce`` of the same tensor (unordered, the floor gloo offers) runs
beside it for comparison. One JSON line: per size, median ms and the effective GB/s
of the exchange, then ``costmodel.scale_out`` at 1/2/4/8 nodes for a Qwen3-8B-shaped
target (per-node rate from the bench's paper projection of 8 GPUs), over common
interconnects and over the loopback gloo rate measured here.
"""

from __future__ import annotations

import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import harness
from dflash_actors.cluster.exchange import Exchange
from dflash_actors.cluster.link import Link
from dflash_actors.cluster.node import NodeSpec
from dflash_actors.runtime.children import free_port
from dflash_actors.train import costmodel
from dflash_actors.train.params import GradAccumulators, ParamLayout, WeightStore
from dflash_actors.train.schedule import Schedule

SIZES = ((41_248, 30), (4_194_304, 12), (33_554_432, 6))
RUNTIME = SimpleNamespace(collective_timeout_s=120.0, replica_check_every=0, start_timeout_s=120.0)
COLS = 37        # a batch-stats row of block size 16


def node(rank: int, port: int, out) -> None:
    torch.set_num_threads(1)
    results = []
    for size, steps in SIZES:
        layout = ParamLayout(("w",), ((size,),))
        sched = Schedule(1, 1, (steps + 1,), 2, rank)
        grads, weights = GradAccumulators.allocate(layout, 1), WeightStore.allocate(layout)
        stats = torch.zeros(sched.total_batches, COLS, dtype=torch.float64)
        x = Exchange.allocate(size, sched.batches_per_step, COLS)
        link = Link(NodeSpec(2, rank, "127.0.0.1", port + len(results)), RUNTIME)
        link.join({}, lambda a, b: [])
        link.serve(x, grads, stats, weights, sched, 0, lambda reason: harness.say(f"failed: {reason}"))
        g = torch.randn(size)
        times = []
        for s in range(steps + 1):
            weights.version_t[0] = s
            grads.commit(0, s, [g])
            t0 = time.perf_counter()
            x.request(s)
            x.wait(s)
            times.append(time.perf_counter() - t0)
        ar = []
        for _ in range(steps + 1):
            t = g.clone()
            t0 = time.perf_counter()
            link.ctl.allreduce([t], dist.AllreduceOptions()).wait()
            ar.append(time.perf_counter() - t0)
        link.stop()
        link.finish("done", steps, "finished", "-")
        link.close()
        ms = statistics.median(times[1:]) * 1e3      # the first pays for connections
        results.append({"params": size, "steps": steps, "exchange_ms_median": round(ms, 3),
                        "allreduce_ms_median": round(statistics.median(ar[1:]) * 1e3, 3),
                        "exchange_gb_per_s": round(size * 4 / (ms / 1e3) / 1e9, 3)})
    out.put((rank, results))


def main(argv=None) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=node, args=(k, port, q)) for k in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(30)
    loopback = got[0]
    harness.say(f"loopback: {loopback}")
    # Per-node rate: the pipeline bench's paper projection (8 GPUs, NVLink, 400 TFLOP/s).
    w, shape = costmodel.Workload(), costmodel.SHAPES["qwen3-8b"]
    best = costmodel.project(shape, w, 400.0)["links"][costmodel.NVLINK.name]["topologies"]["8"]
    drafters = int(best["best"].split("-")[1])
    # The exchange's effective rate on the biggest size here, as if it were a link: 2 transfers per exchange.
    gloo = costmodel.Link("gloo over TCP (loopback here)", 2 * loopback[-1]["exchange_gb_per_s"])
    links = (*costmodel.INTERCONNECTS, gloo)
    estimate = {f"grad_accum={a}": costmodel.scale_out(shape, w, best["tokens_per_s"], a * drafters, links)
                for a in (1, 4)}
    harness.emit({"bench": "cluster", "nodes": 2, "backend": "gloo", "loopback": loopback,
                  "node_split": best["best"], "scale_out": estimate}, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
