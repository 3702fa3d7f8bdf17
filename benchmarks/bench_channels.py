"""Shared-memory ring vs tensors through ``mp.Queue``, between two spawned processes.

One JSON line: ``ring_gbps`` (producer ``copy_`` into a preallocated shared slot, slot
index over a pipe, consumer ``copy_`` out, slot index back), ``queue_gbps`` (producer
``put``s a fresh tensor, which torch moves into a new shared segment; the consumer
``get``s and copies it out), ``memcpy_gbps`` (one process, one ``copy_``) and
``msg_roundtrip_us`` (a ``Work`` out and a ``Done`` back over a pipe). Payloads are
hidden-state sized: ``--tokens`` x ``--layers`` x ``--hidden`` bf16 (default 65,536 x
3 x 576 = 216 MiB). Every process runs one intra-op thread, as the actors do. Both
pipelines hold at most two payloads in flight.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

from benchmarks import harness
from dflash_actors.runtime.channels import FieldSpec, Ring, RingSpec
from dflash_actors.runtime.messages import Done, Work

WARMUP = 2


def _ring_consumer(ring: Ring, conn, n: int, out) -> None:
    torch.set_num_threads(1)
    slots = ring.tensors["hidden"]
    dst = torch.empty_like(slots[0])
    dst.fill_(0)
    for s in range(ring.spec.n_slots):
        conn.send(s)
    t0 = None
    for i in range(n):
        if i == WARMUP:
            t0 = time.perf_counter()
        s, _ = conn.recv()
        dst.copy_(slots[s])
        conn.send(s)
    out.send(time.perf_counter() - t0)


def _queue_producer(q, shape, n: int, conn) -> None:
    torch.set_num_threads(1)
    # Fresh tensors, as a model's outputs would be, made before the clock starts.
    fresh = [torch.randn(shape).to(torch.bfloat16) for _ in range(n)]
    conn.send("ready")
    conn.recv()                       # go
    for _ in range(n):
        q.put(fresh.pop(0))
    conn.recv()                       # the consumer is done with every fd we sent


def _queue_consumer(q, shape, n: int, out) -> None:
    torch.set_num_threads(1)
    dst = torch.zeros(shape, dtype=torch.bfloat16)
    t0 = None
    for i in range(n):
        if i == WARMUP:
            t0 = time.perf_counter()
        t = q.get()
        dst.copy_(t)
        del t
    out.send(time.perf_counter() - t0)


def _echo(conn, n: int) -> None:
    for _ in range(n):
        w = conn.recv()
        conn.send(Done("bench.0", w.batch_id))


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--items", type=int, default=8, help="timed payloads per method (after 2 warmup)")
    p.add_argument("--roundtrips", type=int, default=2000)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    shape = (a.tokens, a.layers * a.hidden)
    n = a.items + WARMUP
    nbytes = shape[0] * shape[1] * 2

    ring_s = _run_ring(ctx, shape, n)
    queue_s = _run_queue(ctx, shape, n)

    src = torch.randn(shape).to(torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(a.items):
        dst.copy_(src)
    memcpy_s = time.perf_counter() - t0

    rtt = _roundtrip(ctx, a.roundtrips)
    gb = a.items * nbytes / 1e9
    ring, queue, memcpy = gb / ring_s, gb / queue_s, gb / memcpy_s
    harness.emit({
        "bench": "channels", "payload_mib": round(nbytes / 2**20, 1), "items": a.items,
        "ring_gbps": round(ring, 3), "queue_gbps": round(queue, 3), "memcpy_gbps": round(memcpy, 3),
        "msg_roundtrip_us": round(rtt, 1),
        "ring_over_queue": round(ring / queue, 2), "ring_over_memcpy": round(ring / memcpy, 3),
        "goals_met": ring >= 4 * queue and ring >= 0.35 * memcpy,
        "threads_per_process": 1,
    }, a.save)
    return 0


def _run_ring(ctx, shape, n) -> float:
    ring = Ring.allocate(RingSpec("bench", 2, (FieldSpec("hidden", shape, "bfloat16"),)))
    prod_end, cons_end = ctx.Pipe()
    go_ours, go_prod = ctx.Pipe()
    res_ours, res_cons = ctx.Pipe()
    prod = ctx.Process(target=_ring_producer, args=(ring, prod_end, go_prod, n))
    cons = ctx.Process(target=_ring_consumer, args=(ring, cons_end, n, res_cons))
    prod.start()
    go_ours.recv()                    # producer attached and made its source
    cons.start()
    elapsed = res_ours.recv()
    go_ours.send("done")
    prod.join()
    cons.join()
    return elapsed


def _ring_producer(ring: Ring, conn, go, n: int) -> None:
    torch.set_num_threads(1)
    slots = ring.tensors["hidden"]
    src = torch.randn(slots.shape[1:]).to(slots.dtype)
    go.send("ready")
    for i in range(n):
        s = conn.recv()               # a free slot, granted by the consumer
        slots[s].copy_(src)
        conn.send((s, i))
    go.recv()


def _run_queue(ctx, shape, n) -> float:
    q = ctx.Queue(maxsize=2)
    go_ours, go_prod = ctx.Pipe()
    res_ours, res_cons = ctx.Pipe()
    prod = ctx.Process(target=_queue_producer, args=(q, shape, n, go_prod))
    prod.start()
    go_ours.recv()
    cons = ctx.Process(target=_queue_consumer, args=(q, shape, n, res_cons))
    cons.start()
    go_ours.send("go")
    elapsed = res_ours.recv()
    go_ours.send("done")
    prod.join()
    cons.join()
    return elapsed


def _roundtrip(ctx, n) -> float:
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_echo, args=(theirs, n + 100))
    p.start()
    times = []
    for i in range(n + 100):
        t0 = time.perf_counter()
        ours.send(Work(i, 0, 1))
        ours.recv()
        if i >= 100:
            times.append(time.perf_counter() - t0)
    p.join()
    return statistics.median(times) * 1e6


if __name__ == "__main__":
    sys.exit(main())
