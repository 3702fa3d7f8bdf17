"""runtime.channels without a GPU: page-locking a ring follows the calling actor's device
(a CPU actor on a GPU host must not pin, which would give it a CUDA context)."""

import torch

from dflash_actors.runtime.channels import FieldSpec, Ring, RingSpec


def test_a_ring_is_pinned_only_for_a_cuda_actor(host_registers):
    ring = Ring.allocate(RingSpec("f", 2, (FieldSpec("x", (4,), "float32"), FieldSpec("n", (3,), "int64"))))
    ring.pin("cpu")
    ring.pin(torch.device("cpu"))
    assert host_registers == []
    ring.pin(torch.device("cuda", 0))
    ring.pin("cuda:0")      # registration is once per process
    x, n = ring.tensors["x"], ring.tensors["n"]
    assert host_registers == ["cudart", (x.data_ptr(), 2 * 4 * 4), (n.data_ptr(), 2 * 3 * 8)]


def test_a_cuda_ring_is_never_pinned(host_registers):
    spec = RingSpec("f", 2, (FieldSpec("x", (4,), "float32"),), device="cuda:0")
    ring = Ring(spec, {"x": torch.zeros(2, 4)})     # its memory is a GPU's: nothing to page-lock
    ring.pin("cuda:0")
    assert host_registers == []
