"""Shared drafter state: the flat parameter layout, the double-buffered weights with
their version commit point, and the per-drafter gradient sums with their header. The
key property: a writer killed between any two tensor writes leaves the committed state
exactly as it was."""

import pytest
import torch

from dflash_actors.train.params import GradAccumulators, ParamLayout, WeightStore


class Killed(Exception):
    """Stands for the writer's death part way through a write."""


def _module():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _layout():
    return ParamLayout.of(_module())


def _state(layout, seed):
    """(weights, exp_avg, exp_avg_sq): distinct per seed, exp_avg_sq >= 0."""
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(s, generator=g) for s in layout.shapes]
    m = [torch.randn(s, generator=g) for s in layout.shapes]
    v = [torch.rand(s, generator=g) + 0.5 for s in layout.shapes]
    return w, m, v


def _dying(tensors, k):
    """Yields the first k tensors, then the writer dies."""
    for t in tensors[:k]:
        yield t
    raise Killed


def _zeros_like_layout(layout):
    return [torch.zeros(s) for s in layout.shapes]


def _assert_all_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# -- layout -------------------------------------------------------------------


def test_layout_of_module():
    layout = _layout()
    assert layout.names == ("weight", "bias")
    assert layout.shapes == ((2, 3), (2,))
    assert layout.numel == 8


def test_views_round_trip_and_share_storage():
    layout = _layout()
    flat = torch.arange(8, dtype=torch.float32)
    w, b = layout.views(flat)
    assert torch.equal(w, torch.tensor([[0.0, 1, 2], [3, 4, 5]]))
    assert torch.equal(b, torch.tensor([6.0, 7]))
    assert torch.equal(torch.cat([v.reshape(-1) for v in (w, b)]), flat)
    # Views, not copies: writing through a view writes the flat buffer.
    b[1] = -1.0
    w[0, 2] = 42.0
    assert flat[7] == -1.0 and flat[2] == 42.0


def test_views_of_module_parameters_round_trip():
    m = _module()
    layout = ParamLayout.of(m)
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    _assert_all_equal(layout.views(flat), [p.detach() for p in m.parameters()])


# -- weight store -------------------------------------------------------------


def test_publish_then_load_and_moments():
    layout = _layout()
    store = WeightStore.allocate(layout)
    assert store.version == 0
    w, m, v = _state(layout, 1)
    store.publish(3, w, m, v)
    assert store.version == 3
    out = _zeros_like_layout(layout)
    store.load_params(out, 3)
    _assert_all_equal(out, w)
    ms, vs = store.moments(3)
    _assert_all_equal(ms, m)
    _assert_all_equal(vs, v)
    mf, vf = store.moments_flat(3)
    assert mf.shape == vf.shape == (8,)
    assert torch.equal(mf, torch.cat([t.reshape(-1) for t in m]))
    assert torch.equal(vf, torch.cat([t.reshape(-1) for t in v]))
    # Version 3 lives in buffer 1; buffer 0 was never written.
    assert torch.equal(store.weights[1], torch.cat([t.reshape(-1) for t in w]))
    assert torch.equal(store.weights[0], torch.zeros(8))


def test_publish_without_moments_zeroes_them():
    layout = _layout()
    store = WeightStore.allocate(layout)
    w, m, v = _state(layout, 1)
    store.publish(0, w, m, v)
    store.publish(2, w, None, None)     # same buffer as version 0
    mf, vf = store.moments_flat(2)
    assert torch.equal(mf, torch.zeros(8))
    assert torch.equal(vf, torch.zeros(8))


def test_load_and_moments_of_an_uncommitted_version_raise():
    layout = _layout()
    store = WeightStore.allocate(layout)
    store.publish(1, *_state(layout, 1))
    out = _zeros_like_layout(layout)
    for bad in (0, 2, 3):
        with pytest.raises(RuntimeError):
            store.load_params(out, bad)
        with pytest.raises(RuntimeError):
            store.moments_flat(bad)
        with pytest.raises(RuntimeError):
            store.moments(bad)
    _assert_all_equal(out, _zeros_like_layout(layout))


def test_problem_none_for_a_good_state():
    layout = _layout()
    store = WeightStore.allocate(layout)
    store.publish(4, *_state(layout, 1))
    assert store.problem(0, 10) is None
    assert store.problem(4, 4) is None


def test_problem_names_an_out_of_range_version():
    layout = _layout()
    store = WeightStore.allocate(layout)
    store.publish(4, *_state(layout, 1))
    for first, last in ((5, 10), (0, 3)):
        msg = store.problem(first, last)
        assert msg is not None and "4" in msg and f"[{first}, {last}]" in msg


@pytest.mark.parametrize("name, bad", [("weights", float("nan")), ("weights", float("inf")),
                                       ("exp_avg", float("-inf")), ("exp_avg_sq", float("nan"))])
def test_problem_names_non_finite_values(name, bad):
    layout = _layout()
    store = WeightStore.allocate(layout)
    store.publish(3, *_state(layout, 1))
    getattr(store, name)[0, 5] = bad       # the inactive buffer: not the committed state
    assert store.problem(0, 10) is None
    getattr(store, name)[1, 5] = bad
    msg = store.problem(0, 10)
    assert msg is not None and msg.startswith(f"{name} of version 3") and "non-finite" in msg


def test_problem_names_negative_second_moment():
    layout = _layout()
    store = WeightStore.allocate(layout)
    store.publish(2, *_state(layout, 1))
    store.exp_avg_sq[1, 1] = -1e-3         # version 2 is buffer 0; buffer 1 is inactive
    store.exp_avg_sq[0, 2] = 0.0           # zero is a legitimate second moment
    assert store.problem(0, 10) is None
    store.exp_avg_sq[0, 3] = -1e-30
    msg = store.problem(0, 10)
    assert msg is not None and "exp_avg_sq" in msg and "negative" in msg


def _interrupted_publish(store, version, new, k):
    """publish(version, new) killed after k of its 3n tensor writes."""
    n = len(new[0])
    seqs = []
    for i, tensors in enumerate(new):
        start = i * n
        seqs.append(tensors if k >= start + n else _dying(tensors, max(0, k - start)))
    with pytest.raises(Killed):
        store.publish(version, *seqs)


def test_publish_killed_between_any_two_writes_keeps_the_committed_version():
    layout = _layout()
    n = len(layout.shapes)
    old, new = _state(layout, 1), _state(layout, 2)
    for start in (0, 1):                 # the new version goes into either buffer
        v = 5 + start
        for k in range(3 * n):
            store = WeightStore.allocate(layout)
            store.publish(v - 1, *_state(layout, 3))
            store.publish(v, *old)
            _interrupted_publish(store, v + 1, new, k)
            assert store.version == v
            out = _zeros_like_layout(layout)
            store.load_params(out, v)
            _assert_all_equal(out, old[0])
            ms, vs = store.moments(v)
            _assert_all_equal(ms, old[1])
            _assert_all_equal(vs, old[2])
            assert store.problem(0, 100) is None
            # The writes before the kill did happen, in the other buffer only.
            inactive = [layout.views(t[(v + 1) % 2]) for t in (store.weights, store.exp_avg, store.exp_avg_sq)]
            written = [t for group, src in zip(inactive, new) for t in zip(group, src)][:k]
            for dst, src in written:
                assert torch.equal(dst, src)
            # The replacement rebuilds v+1 from scratch and commits it.
            store.publish(v + 1, *new)
            assert store.version == v + 1
            store.load_params(out, v + 1)
            _assert_all_equal(out, new[0])


# -- gradient accumulators ----------------------------------------------------


def _grads(layout, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in layout.shapes]


def _add(a, b):
    return [x + y for x, y in zip(a, b)]


def test_grad_accumulators_start_empty():
    layout = _layout()
    acc = GradAccumulators.allocate(layout, 3)
    for j in range(3):
        assert acc.last_batch(j) == -1
        _assert_all_equal(acc.active(j), _zeros_like_layout(layout))


def test_commit_flips_to_the_new_sum():
    layout = _layout()
    acc = GradAccumulators.allocate(layout, 2)
    ga, gb = _grads(layout, 1), _grads(layout, 2)
    acc.commit(1, 3, ga)
    assert acc.last_batch(1) == 3
    _assert_all_equal(acc.active(1), ga)
    acc.commit(1, 5, _add(ga, gb))
    assert acc.last_batch(1) == 5
    _assert_all_equal(acc.active(1), _add(ga, gb))
    # Batch 0 is a real batch id, distinct from "nothing yet".
    acc.commit(0, 0, gb)
    assert acc.last_batch(0) == 0
    _assert_all_equal(acc.active(0), gb)


def test_commit_killed_between_any_two_writes_keeps_the_last_sum():
    layout = _layout()
    n = len(layout.shapes)
    ga, gb, gc = _grads(layout, 1), _grads(layout, 2), _grads(layout, 3)
    g0, g2 = _grads(layout, 4), _grads(layout, 5)
    for committed in (1, 2):             # the interrupted commit targets either buffer
        for k in range(n):
            acc = GradAccumulators.allocate(layout, 3)
            acc.commit(0, 0, g0)
            acc.commit(2, 2, g2)
            acc.commit(1, 1, ga)
            if committed == 2:
                acc.commit(1, 4, _add(ga, gb))
            last = acc.last_batch(1)
            before = [t.clone() for t in acc.active(1)]
            others = {j: (acc.grads[j].clone(), int(acc.head[j])) for j in (0, 2)}
            new = _add(before, gc)
            with pytest.raises(Killed):
                acc.commit(1, 7, _dying(new, k))
            assert acc.last_batch(1) == last
            _assert_all_equal(acc.active(1), before)
            for j, (grads, head) in others.items():
                assert torch.equal(acc.grads[j], grads)
                assert int(acc.head[j]) == head
            # The replacement redoes batch 7 once and the header then names it.
            acc.commit(1, 7, new)
            assert acc.last_batch(1) == 7
            _assert_all_equal(acc.active(1), new)
            assert acc.last_batch(0) == 0 and acc.last_batch(2) == 2


def test_the_header_counts_the_batches_of_a_sum():
    layout = _layout()
    acc = GradAccumulators.allocate(layout, 2)
    g = _grads(layout, 1)
    acc.commit(0, 2, g)
    acc.commit(0, 4, g, count=2)
    acc.commit(0, 6, g, count=3)
    assert (acc.last_batch(0), acc.count(0)) == (6, 3)
    acc.commit(0, 8, g)            # the next step's first batch starts a new sum
    assert (acc.last_batch(0), acc.count(0)) == (8, 1)
    assert (acc.last_batch(1), acc.count(1)) == (-1, 0)
    big = (1 << 40) + 3          # batch ids far beyond any run keep their bits
    acc.commit(1, big, g)
    assert (acc.last_batch(1), acc.count(1)) == (big, 1)


def test_shared_state_is_pinned_only_for_a_cuda_actor(host_registers):
    """A drafter or optimizer on a CPU device (on a GPU host) pins nothing and so gets no
    CUDA context; on a GPU the optimizer pins weights and moments, a drafter the weights."""
    layout = _layout()
    store, acc = WeightStore.allocate(layout), GradAccumulators.allocate(layout, 2)
    for device in ("cpu", torch.device("cpu")):
        acc.pin(device)
        store.pin(device, moments=True)
    assert host_registers == []
    store.pin("cuda:1", moments=False)
    assert host_registers == ["cudart", (store.weights.data_ptr(), 2 * layout.numel * 4)]
    host_registers.clear()
    store.pin(torch.device("cuda", 0), moments=True)
    acc.pin("cuda:0")
    assert [c for c in host_registers if c != "cudart"] == [
        (t.data_ptr(), t.numel() * 4) for t in (store.weights, store.exp_avg, store.exp_avg_sq, acc.grads)]
