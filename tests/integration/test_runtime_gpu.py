"""CUDA paths of the rings: a GPU ring shared by IPC, and a pinned CPU ring."""

import pytest
import torch
import torch.multiprocessing as mp

from dflash_actors.runtime.channels import FieldSpec, Ring, RingSpec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _write_slot(ring, conn):
    # The child sees the supervisor's CUDA memory through the IPC handle; no copy.
    ring.tensors["hidden"][1].fill_(3.0)
    torch.cuda.synchronize()
    conn.send(ring.tensors["hidden"].data_ptr())


def _pinned_copy(ring, conn):
    ring.pin("cuda:0")
    dst = ring.tensors["hidden"][0].to("cuda:0", non_blocking=True)
    torch.cuda.synchronize()
    conn.send(float(dst.sum()))


def _run(target, ring):
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=target, args=(ring, theirs))
    p.start()
    try:
        return ours.recv()
    finally:
        p.join(60)
        assert p.exitcode == 0


def test_cuda_ring_is_shared_by_ipc():
    ring = Ring.allocate(RingSpec("f", 2, (FieldSpec("hidden", (128, 8), "bfloat16"),), device="cuda:0"))
    _run(_write_slot, ring)
    assert float(ring.tensors["hidden"][1].float().sum()) == 3.0 * 128 * 8
    assert float(ring.tensors["hidden"][0].float().sum()) == 0.0


def test_pinned_cpu_ring_copies_to_gpu():
    ring = Ring.allocate(RingSpec("f", 2, (FieldSpec("hidden", (128, 8), "float32"),)))
    ring.tensors["hidden"][0].fill_(2.0)
    assert _run(_pinned_copy, ring) == 2.0 * 128 * 8


def _pinned_sums(grads, conn):
    grads.pin("cuda:0")
    conn.send(float(grads.active_flat(0).to("cuda:0", non_blocking=True).sum()))


def test_pinned_gradient_sums_copy_to_gpu():
    from dflash_actors.train.params import GradAccumulators, ParamLayout

    grads = GradAccumulators.allocate(ParamLayout(("w",), ((64, 8),)), 2)
    grads.commit(0, 3, [torch.full((64, 8), 0.5)])
    assert _run(_pinned_sums, grads) == 0.5 * 64 * 8
