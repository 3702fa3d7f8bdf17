"""One run over several machines: which node this is, and the link between nodes.

Each machine runs ``launch.py`` once: one supervisor with its own loader, targets,
drafters and optimizer, as on a single machine (``schedule``: the node trains a
disjoint shard of the plan, the batches its own drafters consume). The only traffic
between machines is one exchange per optimizer step, made by a ``Link`` thread in
the supervisor process, the one process a local actor restart never touches::

    node 0 supervisor ── Link ── TCPStore (hosted here) ── Link ── node 1 supervisor
          │ shared memory                                             │
    optimizer.0 ──request step s──> Link: barrier "ready/s" in the store,
                <──total, rows───── the stats rows (all-gather), the gradient
                                    chain 0 -> 1 -> ... -> K-1, broadcast back

The gradient chain makes the sum bit-identical to one machine with all K*M drafters:
node 0 starts from its drafter 0's sum and adds its others in order, each next node
receives the running sum and adds its own drafters in order, the last broadcasts the
total. That is exactly ``optim.reduce_and_step``'s order, so the optimizer step on
every node is the single-machine step, and the replicas stay identical (checked:
a hash of weights and moments every ``runtime.replica_check_every`` steps and at
the end). The chain is cut into chunks and pipelined; its cost per node is about two
gradient transfers, like a ring all-reduce.

Failure: a dead actor is restarted locally, and the other nodes just wait (in the
store's barrier, never inside a collective). A node whose supervisor stops beating in
the store for ``runtime.collective_timeout_s``, whose store connection breaks, or
that says it stopped, is lost: the survivors' supervisors stop, node 0 writes its
consistent checkpoint, and every survivor exits 1 naming the lost node; ``--resume``
on every node continues (node 0 broadcasts its checkpoint). Only node 0 writes
checkpoints and runs the evaluator.

Backends: gloo for the control traffic, always; the gradient chain uses NCCL when
``runtime.collective_backend`` says so (``auto``: when the drafters are on CUDA). A lost
node ends an NCCL chain as it ends a gloo one: a failed collective aborts only the
communicator (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` unless set; NCCL's default kills the
supervisor), the chain's end waits with the group's timeout and raises, and the
supervisor aborts the group before it joins the link thread.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..console import first_line
from .exchange import ClusterError, Exchange
from .node import NodeSpec

CHUNK = 1 << 22
"""Gradient floats per chunk of the chain (16 MB): nodes overlap receive, add and send."""
HDR = 7
"""Header of a node's stats row block: step, node, batches, digest (4 x 32 bits)."""
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
"""What NCCL does on a failed or timed-out collective, read when a group is made (the
second name is the deprecated one)."""


def digest(weights, version: int) -> str:
    """Hash of version ``version``'s weights and AdamW moments in a ``WeightStore``."""
    h = hashlib.blake2b(digest_size=16)
    b = version % 2
    for t in (weights.weights[b], weights.exp_avg[b], weights.exp_avg_sq[b]):
        h.update(t.contiguous().numpy().view("uint8").data)
    return h.hexdigest()


def _digest_words(hexd: str) -> list[float]:
    return [float(int(hexd[i:i + 8], 16)) for i in range(0, 32, 8)]


class Link:
    """This node's end of the run's connection to the other nodes (supervisor process)."""

    def __init__(self, node: NodeSpec, runtime, bulk_device: Optional[str] = None):
        self.node, self.timeout_s = node, runtime.collective_timeout_s
        self.check_every = runtime.replica_check_every
        self.join_timeout_s = runtime.start_timeout_s
        self.bulk_device = bulk_device       # a CUDA device: the chain runs on NCCL there
        self.failure: Optional[str] = None
        self.reduce_s: list[float] = []
        self.chain_s: list[float] = []
        self.checked: list[int] = []
        self.waiting: Optional[tuple[list[int], float]] = None
        """(nodes not there yet, since when: monotonic) while in a barrier this long."""
        self._on_fail: Callable[[str], None] = lambda reason: None
        self._exchange: Optional[Exchange] = None
        self._stop = threading.Event()         # the exchange thread
        self._stop_beat = threading.Event()    # the heartbeat thread
        self._closing = False
        self._lock = threading.Lock()
        self._beater: Optional[threading.Thread] = None
        self._server: Optional[threading.Thread] = None
        self.store = self.ctl = self.bulk = None

    # -- joining ----------------------------------------------------------------

    def join(self, fingerprint: dict, compare: Callable[[dict, dict], list[str]]) -> None:
        """Meet every node in the store and form the process groups. Every node checks
        every other's ``fingerprint`` (config, data, shapes) with ``compare`` (the
        differing keys): a node launched differently is bad input, ConfigError."""
        n, timeout = self.node, datetime.timedelta(seconds=self.join_timeout_s)
        host = n.rank == 0 and not n.agent_store
        try:
            self.store = dist.TCPStore(n.addr, n.port, n.nodes if host else None, host, timeout=timeout,
                                       wait_for_workers=False, multi_tenant=False)
        except Exception as e:  # noqa: BLE001 - RuntimeError, DistNetworkError, ... all say the same here
            what = "could not listen on" if host else "could not reach node 0's store at"
            raise ConnectionError(f"cluster: {what} {n.addr}:{n.port} within {self.join_timeout_s:.0f} s "
                                  f"(runtime.start_timeout_s): {first_line(e)}") from None
        mine = json.dumps(fingerprint, sort_keys=True)
        fingerprint = json.loads(mine)      # tuples as the others will read them: lists
        self.store.set(self._key(f"fingerprint/{n.rank}"), mine)
        self._wait_keys([f"fingerprint/{k}" for k in range(n.nodes)], self.join_timeout_s, "join")
        prints = [json.loads(self.store.get(self._key(f"fingerprint/{k}"))) for k in range(n.nodes)]
        # Node 0 holds the store: refusing, it would close it under a node still
        # reading, which would then see the store gone instead of the mismatch. So it
        # waits until every node has read them all.
        self.store.set(self._key(f"read/{n.rank}"), "1")
        if n.rank == 0:
            self._wait_keys([f"read/{k}" for k in range(n.nodes)], self.join_timeout_s, "join")
        for k, theirs in enumerate(prints):
            diff = compare(fingerprint, theirs)
            if diff:
                raise ConfigError(f"cluster: node {k} was launched with another config or data than node "
                                  f"{n.rank} ({', '.join(diff[:4])}); every node must run the same job")
        pg_timeout = datetime.timedelta(seconds=self.timeout_s)
        self.ctl = dist.ProcessGroupGloo(dist.PrefixStore(self._key("gloo"), self.store), n.rank, n.nodes, pg_timeout)
        self.bulk = self.ctl
        if self.bulk_device is not None:
            torch.cuda.set_device(torch.device(self.bulk_device))
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = pg_timeout
            with _abort_communicator_only():
                self.bulk = dist.ProcessGroupNCCL(dist.PrefixStore(self._key("nccl"), self.store), n.rank, n.nodes,
                                                  opts)
        self._beater = _thread(self._beat, "cluster-beat")

    def broadcast_start(self, header: torch.Tensor, body: torch.Tensor) -> None:
        """Node 0's starting point (int64 header, float32 body) to every node, in place."""
        for t in (header, body):
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self.ctl.broadcast([t], opts).wait()

    # -- one exchange per step ---------------------------------------------------

    def serve(self, exchange: Exchange, grads, batch_stats: torch.Tensor, weights, schedule, first_step: int,
              on_fail: Callable[[str], None]) -> None:
        """Reduce every step from ``first_step`` on, as this node's optimizer asks."""
        self._exchange, self._on_fail = exchange, on_fail
        self._grads, self._stats, self._weights, self._sched = grads, batch_stats, weights, schedule
        self._first = first_step    # checked first: the start every node received
        self._stop.clear()
        self._server = _thread(lambda: self._serve(first_step), "cluster-link")
        if self.failure:
            self._fail(self.failure)

    def _serve(self, step: int) -> None:
        try:
            if self.bulk_device is not None:    # the current CUDA device is per thread
                torch.cuda.set_device(torch.device(self.bulk_device))
            while step < self._sched.total_steps:
                while self._exchange.requested() < step:
                    if self._stop.wait(0.001):
                        return
                self._barrier(f"ready/{step}")
                self._reduce(step)
                step += 1
        except Exception as e:  # noqa: BLE001 - anything here ends the run on this node
            if not self._stop.is_set():
                why = f"cross-node exchange of step {step} failed: {first_line(e)}"
                self._fail(self.failure or self._diagnose() or why)

    def _diagnose(self) -> Optional[str]:
        """After a broken collective: which peers stopped beating (over a few beats)."""
        n = self.node
        try:
            before = {k: self.store.add(self._key(f"beat/{k}"), 0) for k in range(n.nodes) if k != n.rank}
            time.sleep(3 * min(1.0, self.timeout_s / 10))
            lost = [k for k, c in before.items() if self.store.add(self._key(f"beat/{k}"), 0) == c]
        except Exception as e:  # noqa: BLE001 - the store's host is gone
            return self._store_gone(e)
        return f"lost node {', '.join(map(str, lost))}: its supervisor stopped beating" if lost else None

    def _store_gone(self, e: BaseException) -> str:
        n = self.node
        if n.rank:
            return f"lost node 0: its store at {n.addr}:{n.port} is gone ({first_line(e)})"
        return f"the store failed: {first_line(e)}"

    def _reduce(self, s: int) -> None:
        t0 = time.perf_counter()
        sched, n, x = self._sched, self.node, self._exchange
        M = sched.num_drafters
        A = sched.per_step // M
        shards = [sched.drafter_batches(s, j) for j in range(M)]   # sums checked by the optimizer before it asked
        check = s == self._first or (self.check_every and s % self.check_every == 0)
        words = _digest_words(digest(self._weights, s)) if check else [0.0] * 4
        rows = self._stats[[b for batches in shards for b in batches]]
        mine = torch.cat([torch.tensor([s, n.rank, sum(self._grads.count(j) for j in range(M)), *words],
                                       dtype=torch.float64), rows.flatten()])
        every = [torch.empty_like(mine) for _ in range(n.nodes)]
        self.ctl.allgather([every], [mine]).wait()
        for k, got in enumerate(every):
            if int(got[0]) != s or int(got[1]) != k:
                raise ClusterError(f"node {k} sent step {int(got[0])} while this node reduces step {s}")
            if check and not torch.equal(got[3:HDR], every[0][3:HDR]):
                raise ClusterError(f"replicas differ: node {k}'s weights and moments at version {s} hash "
                                   f"differently from node 0's; the nodes no longer train the same model")
        if check:
            self.checked.append(s)
        x.rows.view(n.nodes, M * A, -1).copy_(torch.stack([got[HDR:].view(M * A, -1) for got in every]))
        t1 = time.perf_counter()
        self._chain([self._grads.active_flat(j) for j in range(M)], x.total)
        x.head[Exchange.COUNT] = int(sum(got[2] for got in every))
        x.head[Exchange.DONE] = s + 1
        t2 = time.perf_counter()
        self.reduce_s.append(t2 - t0)
        self.chain_s.append(t2 - t1)

    def _chain(self, sums: list[torch.Tensor], total: torch.Tensor) -> None:
        """``total = sums of node 0's drafters, then node 1's, ...`` in that order."""
        rank, last = self.node.rank, self.node.nodes - 1
        dev = self.bulk_device
        work = total if dev is None else torch.empty(total.shape, dtype=total.dtype, device=dev)
        sending = []
        for c, lo in enumerate(range(0, total.numel(), CHUNK)):
            hi = min(total.numel(), lo + CHUNK)
            seg, parts = work[lo:hi], [g[lo:hi] if dev is None else g[lo:hi].to(dev) for g in sums]
            if rank == 0:
                seg.copy_(parts.pop(0))
            else:
                self.bulk.recv([seg], rank - 1, c).wait()
            for g in parts:
                seg.add_(g)
            if rank < last:
                sending.append(self.bulk.send([seg], rank + 1, c))
        for w in sending:
            w.wait()
        opts = dist.BroadcastOptions()
        opts.rootRank = last
        done = self.bulk.broadcast([work], opts)
        if dev is None:
            done.wait()
            return
        # On NCCL a plain wait only orders streams. Blocking, with the group's timeout:
        # a chain cut by a lost node (or an aborted group) raises here instead of
        # handing out a partial sum.
        done.wait(datetime.timedelta(seconds=self.timeout_s))
        total.copy_(work)

    # -- liveness -----------------------------------------------------------------

    def _barrier(self, name: str) -> None:
        """Every node at ``name``, waiting as long as they all live."""
        self.store.set(self._key(f"{name}/{self.node.rank}"), "1")
        self._wait_keys([f"{name}/{k}" for k in range(self.node.nodes)], None, name, stoppable=True)

    def _wait_keys(self, names: list[str], timeout_s: Optional[float], what: str, stoppable: bool = False) -> None:
        keys = [self._key(x) for x in names]

        def missing() -> list[int]:     # names end in a node's rank
            return [int(x.rsplit("/", 1)[1]) for x, k in zip(names, keys) if not self.store.check([k])]
        t0 = time.monotonic()
        end = None if timeout_s is None else t0 + timeout_s
        pause, look = 0.0005, t0 + 0.5
        while not self.store.check(keys):
            if time.monotonic() > look:     # for status.json: who this node waits for
                self.waiting = (missing(), t0)
                look = time.monotonic() + 0.5
            if self.failure:
                raise ClusterError(self.failure)
            if stoppable and self._stop.is_set():
                raise ClusterError("stopping")
            if end is not None and time.monotonic() > end:
                raise ConnectionError(f"cluster: node(s) {', '.join(map(str, missing()))} did not reach {what!r} "
                                      f"within {timeout_s:.0f} s")
            time.sleep(pause)
            pause = min(0.02, pause * 2)
        self.waiting = None

    def _beat(self) -> None:
        """Beat in the store; a peer silent for the timeout, or one that said it
        stopped, or a store that is gone, is a lost node."""
        n, period = self.node, min(1.0, self.timeout_s / 10)
        peers = [k for k in range(n.nodes) if k != n.rank]
        seen = {k: (-1, time.monotonic()) for k in peers}
        while not self._stop_beat.wait(period):
            try:
                self.store.add(self._key(f"beat/{n.rank}"), 1)
                now = time.monotonic()
                for k in peers:
                    count = self.store.add(self._key(f"beat/{k}"), 0)
                    if count != seen[k][0]:
                        seen[k] = (count, now)
                    elif now - seen[k][1] > self.timeout_s and not self._closing:
                        self._fail(f"lost node {k}: no heartbeat from its supervisor for {self.timeout_s:.0f} s "
                                   "(runtime.collective_timeout_s)")
                    if not self._closing and self.store.check([self._key(f"end/{k}")]):
                        end = json.loads(self.store.get(self._key(f"end/{k}")))
                        if end["state"] != "done":
                            self._fail(f"lost node {k}: it stopped ({end['reason']})")
            except Exception as e:  # noqa: BLE001 - the store's host is gone
                if not self._closing:
                    self._fail(self._store_gone(e))
                return

    def _fail(self, reason: str) -> None:
        with self._lock:
            self.failure = self.failure or reason
        if self._exchange is not None:
            self._exchange.head[Exchange.FAILED] = 1
        self._on_fail(self.failure)     # idempotent: the supervisor stops once

    def status(self) -> dict:
        """The ``cluster`` block of status.json."""
        n, waiting = self.node, self.waiting
        out = {"nodes": n.nodes, "rank": n.rank, "master": f"{n.addr}:{n.port}", "steps_exchanged": len(self.reduce_s),
               "exchange_ms_last": round(self.reduce_s[-1] * 1e3, 2) if self.reduce_s else None,
               "exchange_ms_mean": round(_mean(self.reduce_s) * 1e3, 2) if self.reduce_s else None,
               "replica_checks": len(self.checked), "failure": self.failure, "waiting_for": None}
        if waiting is not None and waiting[0]:
            out["waiting_for"] = {"nodes": waiting[0], "s": round(time.monotonic() - waiting[1], 1)}
        return out

    # -- the end ------------------------------------------------------------------

    def stop(self) -> None:
        """End the exchange thread (the supervisor has returned). After a failure the
        NCCL group is aborted first: a chain cut by a lost node would keep the thread
        until the group's timeout."""
        self._stop.set()
        if self.failure and self.bulk_device is not None:
            abort = getattr(self.bulk, "abort", None)    # None: never joined
            if abort is not None:
                abort()
        if self._server is not None:
            self._server.join()
            self._server = None

    def finish(self, state: str, version: int, reason: str, weights_digest: str) -> dict:
        """Tell the others how this node ended and compare: the summary's ``cluster``."""
        n = self.node
        out = {"nodes": n.nodes, "rank": n.rank, "reduce_s_mean": _mean(self.reduce_s),
               "chain_s_mean": _mean(self.chain_s), "replica_checks": len(self.checked), "digest": weights_digest}
        if self.store is None:
            return out
        end = json.dumps({"state": state, "version": version, "reason": reason, "digest": weights_digest})
        if self.failure or state != "done":
            out["replicas"] = "not compared: the run stopped"
            try:
                self.store.set(self._key(f"end/{n.rank}"), end)   # the others stop now, not at their timeout
            except Exception:  # noqa: BLE001 - the store may be what was lost
                pass
            return out
        try:
            self.store.set(self._key(f"end/{n.rank}"), end)
            self._closing = True
            self._wait_keys([f"end/{k}" for k in range(n.nodes)], self.timeout_s, "the end")
            ends = [json.loads(self.store.get(self._key(f"end/{k}"))) for k in range(n.nodes)]
            differ = [k for k, e in enumerate(ends) if (e["version"], e["digest"]) != (version, weights_digest)]
            out["replicas"] = (f"identical at version {version} on all {n.nodes} nodes" if not differ else
                               f"DIFFER: node(s) {differ} end elsewhere than node {n.rank}")
        except Exception as e:  # noqa: BLE001 - the run itself is over; say what could not be compared
            out["replicas"] = f"not compared: {first_line(e)}"
            return out
        try:
            # Not join's read/ keys: those are set already, and node 0 would close its
            # store under a node still reading the ends (seen in CI as "Failed to recv").
            self.store.set(self._key(f"ends-read/{n.rank}"), "1")
            if n.rank == 0:     # the store lives here: keep it until every node has read it
                self._wait_keys([f"ends-read/{k}" for k in range(n.nodes)], 30.0, "the end")
        except Exception:  # noqa: BLE001 - the comparison is made; node 0 may close its store under this ack
            pass
        return out

    def close(self) -> None:
        self._closing = True
        self._stop.set()
        self._stop_beat.set()
        for t in (self._server, self._beater):
            if t is not None:
                t.join(timeout=5)
        self._server = self._beater = None
        self.ctl = self.bulk = None
        self.store = None

    # -- helpers ------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self.node.prefix + name


@contextlib.contextmanager
def _abort_communicator_only():
    """While an NCCL group is made: on a failed or timed-out collective abort its
    communicator (2) instead of NCCL's default (3), which takes the whole process down:
    here the supervisor, before it can end naming the lost node, with node 0's final
    checkpoint. Not where the user chose; for this group only, not for actors spawned later."""
    if any(k in os.environ for k in NCCL_ERROR_HANDLING):
        yield
        return
    os.environ[NCCL_ERROR_HANDLING[0]] = "2"
    try:
        yield
    finally:
        os.environ.pop(NCCL_ERROR_HANDLING[0], None)


def _thread(fn, name: str) -> threading.Thread:
    t = threading.Thread(target=fn, name=name, daemon=True)
    t.start()
    return t


def _mean(xs: list[float]) -> Optional[float]:
    return round(sum(xs) / len(xs), 6) if xs else None
