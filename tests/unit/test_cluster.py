"""Several machines, without the machines: the node spec from flags and from torchrun's
and SLURM's environment, and the Link of K nodes as K threads over loopback gloo (the
exchange's sum against one machine's order, bit for bit; the replica check; a lost
node; nodes launched with different jobs); and, the NCCL group stood in for, how an
NCCL chain meets a lost node."""

import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from dflash_actors.cluster import link
from dflash_actors.cluster.exchange import ClusterError, Exchange
from dflash_actors.cluster.link import Link
from dflash_actors.cluster.node import DEFAULT_PORT, NodeSpec, first_host, launcher_restart, node_spec
from dflash_actors.config import ConfigError
from dflash_actors.train.optim import reduce_and_step
from dflash_actors.train.params import GradAccumulators, ParamLayout, WeightStore
from dflash_actors.train.schedule import Schedule
from tests.support.pipeline import free_port

# -- the node spec ------------------------------------------------------------


def test_one_node_unless_told():
    assert node_spec(env={}) == NodeSpec()
    assert node_spec(env={"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).single


def test_flags():
    n = node_spec(2, 1, "10.0.0.7:29600", env={"WORLD_SIZE": "8", "MASTER_ADDR": "x"})   # flags win
    assert (n.nodes, n.rank, n.addr, n.port, n.agent_store) == (2, 1, "10.0.0.7", 29600, False)
    assert node_spec(1, env={}).single


@pytest.mark.parametrize("args,says", [
    ((2, 2, "h:1"), "--node-rank: must be in [0, 1]"),
    ((2, None, "h:1"), "needs --node-rank and --master"),
    ((None, 0, "h:1"), "--nnodes: needed"),
    ((2, 0, "h"), "--master: expected ADDR:PORT"),
    ((2, 0, "h:70000"), "master port"),
    ((0, 0, "h:1"), "--nnodes: must be >= 1"),
])
def test_bad_flags_say_which(args, says):
    with pytest.raises(ValueError, match=None) as e:
        node_spec(*args, env={})
    assert says in str(e.value)


def test_torchrun_environment():
    env = {"WORLD_SIZE": "4", "GROUP_RANK": "3", "RANK": "3", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "n0",
           "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    n = node_spec(env=env)
    assert (n.nodes, n.rank, n.addr, n.port, n.agent_store, n.prefix) == (4, 3, "n0", 29400, True, "dflash/2/")
    with pytest.raises(ValueError, match="--nproc-per-node 1"):
        node_spec(env=env | {"LOCAL_WORLD_SIZE": "8"})


def test_slurm_environment():
    env = {"SLURM_NTASKS": "3", "SLURM_PROCID": "2", "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "gpu[07-09]"}
    n = node_spec(env=env)
    assert (n.nodes, n.rank, n.addr, n.port) == (3, 2, "gpu07", DEFAULT_PORT)
    assert node_spec(env=env | {"MASTER_ADDR": "head", "MASTER_PORT": "1234"}).addr == "head"
    with pytest.raises(ValueError, match="--ntasks-per-node 1"):
        node_spec(env=env | {"SLURM_NNODES": "1"})


@pytest.mark.parametrize("nodelist,host", [("gpu[07-09,12],cpu1", "gpu07"), ("a1,a2", "a1"), ("node5", "node5"),
                                           ("x[3,5]", "x3")])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_a_relaunch_by_torchrun_or_slurm_is_counted():
    assert launcher_restart({}) == 0
    assert launcher_restart({"TORCHELASTIC_RESTART_COUNT": "0"}) == 0
    assert launcher_restart({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert launcher_restart({"SLURM_RESTART_COUNT": "1"}) == 1


# -- the link -------------------------------------------------------------------


RUNTIME = SimpleNamespace(collective_timeout_s=3.0, replica_check_every=2, start_timeout_s=20.0)
SHAPES = ((7, 5), (11,), (3, 3))
LAYOUT = ParamLayout(("a", "b", "c"), SHAPES)
P = LAYOUT.numel
COLS = 4


class Node:
    """One node's shared state, as its drafters would leave it for step s."""

    def __init__(self, k: int, nodes: int, m: int, accum: int, port: int, runtime=RUNTIME):
        self.k, self.m, self.accum = k, m, accum
        self.sched = Schedule(accum * m, m, (4,), nodes, k)
        self.grads = GradAccumulators.allocate(LAYOUT, m)
        self.weights = WeightStore.allocate(LAYOUT)
        self.stats = torch.zeros(self.sched.total_batches, COLS, dtype=torch.float64)
        self.exchange = Exchange.allocate(P, self.sched.batches_per_step, COLS)
        self.link = Link(NodeSpec(nodes, k, "127.0.0.1", port), runtime)
        self.failures: list[str] = []

    def fill(self, step: int, sums: list[torch.Tensor]) -> None:
        """Drafter j's sum for ``step`` = sums[j] (already added up), its stats rows the
        batches' global ids."""
        self.weights.version_t[0] = step
        for j in range(self.m):
            batches = list(self.sched.drafter_batches(step, j))
            for i, b in enumerate(batches):
                self.grads.commit(j, b, LAYOUT.views(sums[j]), count=i + 1)
                self.stats[b] = float(self.sched.global_id(b))


def run_nodes(nodes: int, m: int, accum: int, body, runtime=RUNTIME):
    """Join K linked nodes in threads, run ``body(node)`` on each, close them."""
    port = free_port()
    ns = [Node(k, nodes, m, accum, port, runtime) for k in range(nodes)]
    errors = {}

    def go(n: Node):
        try:
            n.link.join({"job": 1}, lambda a, b: [] if a == b else ["job"])
            n.link.serve(n.exchange, n.grads, n.stats, n.weights, n.sched, 0, n.failures.append)
            body(n)
        except BaseException as e:  # noqa: BLE001 - reported below, per node
            errors[n.k] = e
        finally:
            n.link.stop()

    threads = [threading.Thread(target=go, args=(n,)) for n in ns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for n in ns:
        n.link.close()
    return ns, errors


@pytest.mark.parametrize("nodes,m,accum", [(2, 1, 1), (3, 2, 2)])
def test_exchange_is_the_single_machine_sum_bit_for_bit(monkeypatch, nodes, m, accum):
    """Every node gets the sum of all K*M drafters in one machine's order (checked with
    ``optim.reduce_and_step``'s own summation), the stats rows in global drafter order,
    and the batch count; chunks small enough that the chain pipelines several."""
    monkeypatch.setattr(link, "CHUNK", 16)
    gen = torch.Generator().manual_seed(0)
    steps = 3
    sums = [[torch.randn(P, generator=gen) * 10 ** (j % 4) for j in range(nodes * m)] for _ in range(steps)]
    got = {}

    def body(n: Node):
        for s in range(steps):
            n.fill(s, sums[s][n.k * m:(n.k + 1) * m])
            n.exchange.request(s)
            n.exchange.wait(s)
            got[n.k, s] = (n.exchange.total.clone(), n.exchange.rows[:, 0].clone(), n.exchange.count)

    ns, errors = run_nodes(nodes, m, accum, body)
    assert not errors, errors
    whole = Schedule(accum * m * nodes, m * nodes, (4,))
    for s in range(steps):
        params = [torch.zeros(shape, requires_grad=True) for shape in SHAPES]
        opt = torch.optim.SGD(params, lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        reduce_and_step(params, [LAYOUT.views(g) for g in sums[s]], opt, sched, 1, 1e30)
        want = torch.cat([p.grad.reshape(-1) for p in params])
        rows = [float(b) for j in range(m * nodes) for b in whole.drafter_batches(s, j)]
        for k in range(nodes):
            total, order, count = got[k, s]
            assert torch.equal(total, want), (k, s)
            assert order.tolist() == rows
            assert count == whole.per_step
    assert all(n.link.checked == [0, 2] for n in ns)       # the first step, then every 2nd
    assert all(len(n.link.reduce_s) == steps for n in ns) and not any(n.failures for n in ns)


def test_replicas_that_differ_stop_every_node():
    def body(n: Node):
        n.fill(0, [torch.ones(P)])
        if n.k == 1:
            n.weights.exp_avg_sq[0, 3] = 1e-9     # one moment, one entry
        n.exchange.request(0)
        with pytest.raises(ClusterError, match="abandoned"):
            n.exchange.wait(0)

    ns, errors = run_nodes(2, 1, 1, body)
    assert not errors, errors
    for n in ns:
        assert n.failures and "replicas differ: node 1's weights and moments at version 0" in n.failures[0]


def test_a_node_that_stops_beating_is_named_within_the_timeout():
    """Node 2 goes silent (its supervisor died): nodes 0 and 1, waiting for it in the
    barrier, fail naming it, within the timeout plus a beat."""
    t_gone = {}

    def body(n: Node):
        if n.k == 2:
            n.link._stop_beat.set()           # what a kill -9 of its supervisor leaves
            t_gone[0] = time.monotonic()
            return
        n.fill(0, [torch.ones(P)])
        n.exchange.request(0)
        with pytest.raises(ClusterError):
            n.exchange.wait(0)
        t_gone[n.k + 1] = time.monotonic()

    ns, errors = run_nodes(3, 1, 1, body)
    assert not errors, errors
    for n in ns[:2]:
        assert n.failures[0].startswith("lost node 2: no heartbeat from its supervisor for 3 s"), n.failures
    assert max(t_gone[1], t_gone[2]) - t_gone[0] < RUNTIME.collective_timeout_s + 2


def test_a_node_that_says_it_stopped_stops_the_others_at_once():
    def body(n: Node):
        if n.k == 1:
            n.link.finish("failed", 0, "drafter.0 kept dying", "x")
            return
        n.fill(0, [torch.ones(P)])
        n.exchange.request(0)
        t0 = time.monotonic()
        with pytest.raises(ClusterError):
            n.exchange.wait(0)
        assert time.monotonic() - t0 < RUNTIME.collective_timeout_s

    ns, errors = run_nodes(2, 1, 1, body)
    assert not errors, errors
    assert ns[0].failures[0] == "lost node 1: it stopped (drafter.0 kept dying)"


def test_nodes_launched_with_different_jobs_refuse_to_start():
    port, raised = free_port(), {}

    def go(k):
        link = Link(NodeSpec(2, k, "127.0.0.1", port), RUNTIME)
        try:
            link.join({"lr": 0.1 * (k + 1)}, lambda a, b: [] if a == b else ["train.lr"])
        except ConfigError as e:
            raised[k] = str(e)
        finally:
            link.close()

    threads = [threading.Thread(target=go, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(raised) == {0, 1}
    assert "another config or data than node" in raised[0] and "train.lr" in raised[0]


def test_a_node_that_never_comes_is_named():
    link = Link(NodeSpec(2, 0, "127.0.0.1", free_port()), SimpleNamespace(**vars(RUNTIME) | {"start_timeout_s": 1.0}))
    try:
        with pytest.raises(ConnectionError, match=r"node\(s\) 1 did not reach 'join' within 1 s"):
            link.join({}, lambda a, b: [])
    finally:
        link.close()


def test_the_end_compares_the_replicas():
    def body(n: Node):
        n.result = n.link.finish("done", 4, "finished", "abc" if n.k == 0 else "abd")

    ns, errors = run_nodes(2, 1, 1, body)
    assert not errors, errors
    assert ns[0].result["replicas"].startswith("DIFFER: node(s) [1]")
    assert ns[1].result["replicas"].startswith("DIFFER: node(s) [0]")


def test_node_0_keeps_its_store_until_every_node_has_read_the_ends():
    """Node 0 hosts the store and its supervisor ends right after ``finish``: a node
    slow to read the ends still compares them (CI once saw "not compared: Failed to
    recv" when node 0 took join's acknowledgements for the end's)."""
    class SlowReads:
        def __init__(self, store):
            self._store = store

        def get(self, key):
            time.sleep(0.5)
            return self._store.get(key)

        def __getattr__(self, name):
            return getattr(self._store, name)

    def body(n: Node):
        if n.k == 1:
            n.link.store = SlowReads(n.link.store)
        n.result = n.link.finish("done", 4, "finished", "abc")
        if n.k == 0:
            n.link.close()

    ns, errors = run_nodes(2, 1, 1, body)
    assert not errors, errors
    assert [n.result["replicas"] for n in ns] == ["identical at version 4 on all 2 nodes"] * 2


# -- the NCCL chain's failure path (no GPU: the group is stood in for) ---------


class FakeNCCL:
    """Records the error handling NCCL would read when the group is made."""

    made: list = []
    Options = SimpleNamespace

    def __init__(self, store, rank, size, opts):
        FakeNCCL.made.append({k: os.environ.get(k) for k in link.NCCL_ERROR_HANDLING})


@pytest.mark.parametrize("user", [None, ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"), ("NCCL_ASYNC_ERROR_HANDLING", "1")])
def test_the_nccl_group_aborts_its_communicator_rather_than_the_supervisor(monkeypatch, user):
    """NCCL's default (3) would kill the supervisor on a collective that a lost node
    leaves hanging; the group is made with 2 (abort the communicator only), for its own
    construction, unless the user chose (either name)."""
    for k in link.NCCL_ERROR_HANDLING:
        monkeypatch.delenv(k, raising=False)
    if user:
        monkeypatch.setenv(*user)
    monkeypatch.setattr(link.dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(link.torch.cuda, "set_device", lambda device: None)
    FakeNCCL.made = []
    before = dict(os.environ)
    node = Link(NodeSpec(1, 0, "127.0.0.1", free_port()), RUNTIME, bulk_device="cuda:0")
    try:
        node.join({}, lambda a, b: [])
    finally:
        node.close()
    chosen = dict([user]) if user else {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert FakeNCCL.made == [{k: chosen.get(k) for k in link.NCCL_ERROR_HANDLING}]
    assert dict(os.environ) == before      # actors spawned later keep NCCL's default


def test_gloo_chains_make_no_nccl_group(monkeypatch):
    monkeypatch.setattr(link.dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    FakeNCCL.made = []
    node = Link(NodeSpec(1, 0, "127.0.0.1", free_port()), RUNTIME)
    try:
        node.join({}, lambda a, b: [])
        assert node.bulk is node.ctl
    finally:
        node.close()
    assert FakeNCCL.made == []


@pytest.mark.parametrize("failure", [None, "lost node 1: no heartbeat from its supervisor for 3 s"])
def test_after_a_lost_node_the_nccl_group_is_aborted_before_the_link_thread_is_joined(failure):
    """A chain cut by a lost node never completes on NCCL: the link thread waits in it
    until the group is aborted, so ``stop`` aborts first (and only after a failure)."""
    node = Link(NodeSpec(2, 0, "127.0.0.1", free_port()), RUNTIME, bulk_device="cuda:0")
    aborted = threading.Event()
    node.ctl, node.bulk = object(), SimpleNamespace(abort=aborted.set)
    freed = []
    node._server = threading.Thread(target=lambda: freed.append(aborted.wait(0.5 if failure is None else 30)))
    node._server.start()
    node.failure = failure
    node.stop()
    assert freed == [failure is not None] and aborted.is_set() == (failure is not None)
