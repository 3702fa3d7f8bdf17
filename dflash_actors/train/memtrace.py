"""What the drafter's step, the target's forward and the optimizer's step hold on a
device, traced at any size: each is the project's own code (``loss.blocks_loss``,
``TargetModel.features``, ``optim.reduce_and_step``), never a copy of it.

The real code runs under ``FakeTensorMode``: every tensor carries its shape, dtype and
device but no memory, so a step at an 8B target's shapes traces in about a second on
this CPU. ``Live`` follows every storage an op creates and every one that is freed
(the weights, gradients and inputs, which exist before the step, are registered first
and never counted), which gives the step's peak; ``torch.autograd.graph``'s saved-tensor
hooks give what the forward keeps for the backward. (PyTorch's own ``MemTracker`` does
the first and more, but it hooks every parameter for gradients, which a frozen target
or head refuses.)

A CPU-only build makes fake CUDA tensors but runs no CUDA kernel on them (a random
init, a move to the device, flex attention), so a drafter's CUDA step is traced on the
CPU with what differs replaced: bf16 autocast as CUDA's (linears and matmuls in bf16; the RMSNorms
cast to fp32 themselves), and flex attention, which has no CPU backward, by a stand-in
that keeps what flex's autograd keeps (query, key, value, output and the row
log-sum-exp) and allocates what its backward does. Kernels' own workspaces and the
caching allocator's rounding are not traced: the plan adds a margin for them
(``train.memplan``). The optimizer's step needs none of those: it runs on fake tensors
made on its own device's kind, so AdamW takes the path torch takes there (multi-tensor
on a GPU).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..data.batching import Batch
from ..models import blocks as BL
from ..models import loss as L
from ..models.dflash2 import SelectorObjective
from ..models.drafter import DFlashDrafter, drafter_config
from ..models.dspark import DSparkObjective
from ..models.marks import OFF_MUON, keep_off_muon
from ..models.xpress import XPressObjective
from . import optim

TRACE_GAMMA = 7.0
"""The loss's position decay in a traced step: any value, it weighs slots but shapes nothing."""
TRACED_SCALAR = 1.0
"""What the optimizer's step reads for the values a trace has not (the gradient's norm,
AdamW's step count): finite, so the step takes its update path, the one that allocates."""


class Live(TorchDispatchMode):
    """Bytes of the storages ops create while it is active, now and at the peak. Storages
    passed to ``known`` exist already and are not counted, nor are views of them.
    ``scalar``: what a tensor's value reads as (``.item()``), which a fake tensor has
    not; None: reading one is an error, as it is under ``FakeTensorMode`` alone."""

    def __init__(self, scalar: float | None = None):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.now = self.peak = 0
        self.scalar = scalar

    def known(self, tensors) -> None:
        for t in tensors:
            if t is not None:
                self.sizes.setdefault(t.untyped_storage()._cdata, 0)

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.sizes:
            return
        n = st.nbytes()
        self.sizes[key] = n
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.scalar is not None and func is torch.ops.aten._local_scalar_dense.default:
            return self.scalar
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


@contextlib.contextmanager
def saved_bytes(known_tensors, into: list):
    """Bytes of the distinct storages autograd saves for the backward inside, weights and
    inputs (``known_tensors``) excluded; appended to ``into`` on exit."""
    skip = {t.untyped_storage()._cdata for t in known_tensors if t is not None}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in skip:
            seen.setdefault(st._cdata, st.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    into.append(sum(seen.values()))


class _FlexStandIn(torch.autograd.Function):
    """flex_attention's memory without its arithmetic: the forward keeps q, k, v, the
    output and the fp32 log-sum-exp per query row; the backward makes the row deltas and
    the three gradients (GQA's at the key/value heads' size, as flex's kernel does)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _, _ = ctx.saved_tensors
        torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)    # the deltas
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def flex_stand_in(anchors, lengths, ctx_len: int, block_size: int, window=None):
    """``make_attend``'s CUDA attention, for a trace (``loss.attention_as``): a window
    changes which tiles flex computes, not what it keeps."""
    def attend(q, k, v):
        dev = q.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q.dtype
        return _FlexStandIn.apply(*(t.to(dtype) for t in (q, k, v)))
    return attend


@dataclass(frozen=True)
class StepTrace:
    """Bytes a traced step allocates beyond the weights, gradients and inputs it starts with."""

    saved: int
    """Kept by the forward for the backward (activations)."""
    peak: int
    """At the step's peak: activations and every transient (autocast's bf16 weight
    copies, head chunks, the backward's temporaries)."""


def packed_batch(rows: int, length: int) -> Batch:
    """``rows`` sequences of ``length`` tokens, every token supervised (ids are zeros:
    a trace never reads them)."""
    T = rows * length
    return Batch(torch.zeros(T, dtype=torch.long), torch.arange(length).repeat(rows),
                 torch.ones(T, dtype=torch.int8), torch.arange(0, T + 1, length, dtype=torch.int32), length)


def spread_anchors(rows: int, length: int, anchors: int) -> list[np.ndarray]:
    """``anchors`` (at most ``length - 1``) positions per row, evenly spread."""
    n = max(1, min(anchors, length - 1))
    return [np.linspace(0, length - 2, n).round().astype(np.int64) for _ in range(rows)]


def trace_xpress(loss: str) -> XPressObjective:
    """The XPress passes a trace runs: speculators' defaults, with data labels and no TV
    when the features carry no teacher (the only XPress such a run may train)."""
    return XPressObjective() if loss == "distill" else XPressObjective(1.0, 0.0, ce_labels="data")


def trace_drafter_step(target_config, *, layers: int, block_size: int, feature_layers: int, head_dtype: torch.dtype,
                       autocast_bf16: bool, cuda: bool, rows: int, ctx_len: int, anchors: int,
                       checkpoint_layers: bool = False, head_loss: str = "fused", loss: str = "ce",
                       dflash2: dict | None = None, shape: dict | None = None,
                       dspark: dict | None = None, xpress: dict | None = None) -> StepTrace:
    """One micro-batch of ``rows`` rows of ``ctx_len`` tokens with ``anchors`` anchors each
    through the real ``blocks_loss`` and backward, for a drafter of ``layers`` layers shaped
    like ``target_config`` reading ``feature_layers`` target layers (and the teacher's last
    layer with ``loss="distill"``). ``cuda``: attention as on a GPU (flex), else the CPU's
    own (a dense mask for sdpa). Gradients exist already (a running sum), as from a
    step's second micro-batch on. ``dflash2``: a DFlash2's sizes (``drafter.dflash2_fields``),
    its selector term included; ``dspark``: a DSpark's (``dspark.dspark_fields``), its
    heads and three terms included; ``xpress``: an XPress's (``xpress.xpress_fields``), its
    refiner and default passes included."""
    H, V = int(target_config.hidden_size), int(target_config.vocab_size)
    batch = packed_batch(rows, ctx_len)
    blocks = L.lay_out(batch, spread_anchors(rows, ctx_len, anchors), block_size, "cpu", int(dspark is not None))
    with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        drafter = DFlashDrafter(drafter_config(target_config, layers, block_size, list(range(feature_layers)), V - 1,
                                               "trace", V, dflash2, shape, dspark, xpress))
        for p in drafter.parameters():
            p.grad = torch.zeros_like(p)
        head = SimpleNamespace(embed_tokens=torch.nn.Embedding(V, H, dtype=head_dtype).requires_grad_(False),
                               lm_head=torch.nn.Linear(H, V, bias=False, dtype=head_dtype).requires_grad_(False))
        features = torch.empty(rows * ctx_len, (feature_layers + (loss == "distill")) * H, dtype=head_dtype)
        start = [*drafter.parameters(), *(p.grad for p in drafter.parameters()), *drafter.buffers(),
                 head.embed_tokens.weight, head.lm_head.weight, features]
        live, saved = Live(), []
        live.known(start)
        attention = BL.attention_as(flex_stand_in) if cuda else contextlib.nullcontext()
        with attention, live:
            with saved_bytes(start, saved):
                value, _ = L.blocks_loss(drafter, head, features, blocks, TRACE_GAMMA,
                                         compute_dtype="bfloat16" if autocast_bf16 else "float32",
                                         head_loss=head_loss, loss=loss, checkpoint_layers=checkpoint_layers,
                                         selector=None if dflash2 is None else SelectorObjective(),
                                         dspark=None if dspark is None else DSparkObjective(),
                                         xpress=None if xpress is None else trace_xpress(loss))
            value.backward()
            del value
    return StepTrace(saved[0], live.peak)


def probe_config(target_config, feature_layers: int):
    """A copy of ``target_config`` cut to the fewest layers that hold ``feature_layers``
    of them and one of each kind it has (``layer_types``: linear and full attention).
    Under no_grad a forward frees each layer's temporaries before the next, so its peak
    is one layer's plus what the wrapper keeps, the same in the cut model as in the
    whole one: which the trace of a hybrid model's slow reference kernels needs."""
    import copy
    probe = copy.deepcopy(target_config)
    kinds = list(getattr(target_config, "layer_types", None) or ())
    seen = max((kinds.index(k) + 1 for k in set(kinds)), default=0)
    n = min(int(target_config.num_hidden_layers), max(feature_layers, seen, 1))
    probe.num_hidden_layers = n
    if kinds:
        probe.layer_types = kinds[:n]
    return probe


def trace_target_forward(target_config, *, dtype: torch.dtype, rows: int, length: int, layer_ids: list[int],
                         teacher: bool = False) -> StepTrace:
    """The target wrapper's features of ``rows`` sequences of ``length`` tokens, under
    no_grad, for a model built from ``target_config`` in ``dtype`` (weights not counted),
    traced on its ``probe_config``: the same layers kept, one layer's temporaries."""
    from transformers import AutoModelForCausalLM

    from ..models.target import TargetModel
    from ..models.target_dir import attention_for
    batch = packed_batch(rows, length)
    probe = probe_config(target_config, len(layer_ids))
    n = int(probe.num_hidden_layers)
    with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True), experts_fallback():
        model = AutoModelForCausalLM.from_config(probe, dtype=dtype, attn_implementation=attention_for(probe))
        target = TargetModel(model, [max(0, n - len(layer_ids) + i) for i in range(len(layer_ids))], teacher=teacher)
        # The target actor writes straight into its feature slot, which the ring's part counts.
        slot = torch.empty(rows * length, len(target.feature_ids) * int(probe.hidden_size), dtype=dtype)
        live = Live()
        live.known([*model.parameters(), *model.buffers(), slot])
        with live:
            target.features(batch, out=slot)
    return StepTrace(0, live.peak)


@contextlib.contextmanager
def experts_fallback():
    """A MoE target's experts traced through transformers' own fallback for
    ``grouped_mm``, whose output is the same ``[tokens, width]``: torch's meta kernel for
    ``grouped_mm`` refuses float32, which its CPU kernel runs (a CPU target's dtype), and
    transformers asks a CUDA weight's device for its capability, which a plan made for
    GPUs elsewhere (``--gpu-memory``) does not have."""
    from transformers.integrations import moe
    usable = getattr(moe, "_can_use_grouped_mm", None)
    if usable is None:
        yield
        return
    moe._can_use_grouped_mm = lambda *args: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = usable


def target_numel(target_config) -> int:
    """Parameters of the model ``target_config`` describes (tied ones once), built without memory."""
    from transformers import AutoModelForCausalLM
    with torch._subclasses.fake_tensor.FakeTensorMode():
        model = AutoModelForCausalLM.from_config(target_config)
        return sum(p.numel() for p in model.parameters())


def target_rank_numel(target_config, ranks: int) -> int:
    """Parameters each rank of a gang of ``ranks`` holds: its share of what transformers'
    tensor-parallel plan splits, and every weight it keeps whole (``tensor_parallel.split_of``)."""
    from ..models.tensor_parallel import split_of
    return split_of(target_config, ranks).per_rank


def drafter_numel(target_config, layers: int, block_size: int, feature_layers: int,
                  dflash2: dict | None = None, shape: dict | None = None, dspark: dict | None = None,
                  xpress: dict | None = None) -> int:
    """Parameters of a drafter of ``layers`` layers for ``target_config``, built without memory."""
    V = int(target_config.vocab_size)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        d = DFlashDrafter(drafter_config(target_config, layers, block_size, list(range(feature_layers)), V - 1,
                                         "count", V, dflash2, shape, dspark, xpress))
        return sum(p.numel() for p in d.parameters())


@contextlib.contextmanager
def fakes_take_multi_tensor_paths():
    """While inside, torch's choice between its multi-tensor kernels (AdamW's foreach,
    the clip's norms) and the one-tensor-at-a-time loop sees a fake tensor as the tensor
    it stands for. torch takes those kernels only for tensors of exactly its own types,
    and a fake is a subclass: without this, a trace would take the loop, whose
    temporaries are one parameter's, where a GPU run takes foreach's, the whole model's."""
    from torch.optim import optimizer as torch_optimizer
    from torch.utils import _foreach_utils
    kinds = (torch_optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types)
    for k in kinds:
        k.append(torch._subclasses.fake_tensor.FakeTensor)
    try:
        yield
    finally:
        for k in kinds:
            k.remove(torch._subclasses.fake_tensor.FakeTensor)


def trace_optimizer_step(target_config, *, layers: int, block_size: int, feature_layers: int, drafters: int,
                         train, device: str = "cuda", dflash2: dict | None = None,
                         shape: dict | None = None, dspark: dict | None = None,
                         xpress: dict | None = None) -> StepTrace:
    """The optimizer actor's own step for a drafter of this shape on a ``device`` of that
    kind: ``optim.build_optimizer`` and ``build_scheduler`` from ``train`` (the run's
    ``TrainConfig``), then ``optim.reduce_and_step`` over ``drafters`` gradient sums in
    host memory, read one at a time, as the actor reads them. AdamW takes the path torch
    picks for that device (multi-tensor on a GPU); its moments are created by the step,
    so they are counted, as the gradient sum and the clip's temporaries are."""
    V = int(target_config.vocab_size)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        shell = DFlashDrafter(drafter_config(target_config, layers, block_size, list(range(feature_layers)), V - 1,
                                             "trace", V, dflash2, shape, dspark, xpress))
        # Made on the device, not moved there: a CPU build fakes a CUDA tensor, not a copy to one.
        params = [torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device)) for p in shell.parameters()]
        # ``train.optimizer: muon`` splits them as the shell's own are split (``optim.takes_muon``).
        keep_off_muon(*(q for p, q in zip(shell.parameters(), params) if getattr(p, OFF_MUON, False)))
        shards = [[torch.empty(p.shape, dtype=p.dtype) for p in params] for _ in range(drafters)]
        opt = optim.build_optimizer(params, train)
        sched = optim.build_scheduler(opt, train, 1)
        live = Live(scalar=TRACED_SCALAR)
        live.known([*params, *(g for s in shards for g in s)])
        with fakes_take_multi_tensor_paths(), live:
            optim.reduce_and_step(params, iter(shards), opt, sched, drafters, train.grad_clip)
    return StepTrace(0, live.peak)
