"""Back-of-envelope cost model of the training pipeline: what ``make bench`` and ``--topology auto`` reason with.

Three parts, all plain arithmetic on floats (no torch, nothing measured here):

1. **Throughput of the pipeline.** A batch passes the loader (one actor, ``a`` s/batch), one of ``N`` target
   actors (``t`` s/batch each) and one of ``M`` drafter actors (``d`` s/batch each); the optimizer (one actor)
   spends ``o`` s per optimizer *step*. A step is ``P = g*M`` batches (``g`` = grad_accum), each drafter doing
   ``g`` of them. The steady-state rate of a pipeline is bounded by its slowest stage::

       bound = min(1/a, N/t, P/(g*d + o))      batches/s

   The drafter term includes ``o`` because training is synchronous: a drafter cannot start step s+1 before the
   optimizer has finished step s, so one drafter's chain costs ``g*d + o`` per step. A zero cost means the
   stage never limits (infinite rate). The old lock-step loop did the stages one after another per step::

       lockstep = P / (P*a + ceil(P/N)*t + g*d + o)

   and ``bound / lockstep`` is the most the actor pipeline can gain over it.

2. **Model shapes and FLOPs**, to simulate stage costs for models we cannot run here. Assumptions:

   * FLOPs of a matmul with ``p`` weights over ``T`` tokens are ``2*p*T``; norms, activations, rotary
     embeddings and softmax are ignored.
   * Attention scores and the weighted sum cost ``4 * heads*head_dim * ctx`` per token and layer, with
     ``ctx`` the mean causal context, half a packed sequence: ``(token_budget / sequences_per_batch) / 2``.
   * The target runs forward only, without its LM head (the drafter needs hidden features, not logits).
   * The drafter has ``drafter_layers`` layers of the target's shape plus an ``fc`` that projects
     ``feature_layers`` concatenated hidden states to one; its LM head and embeddings are the target's,
     frozen, and not counted as drafter parameters.
   * Drafter forward+backward is 3x forward. The frozen LM head needs no weight gradient, but its backward to
     the hidden state still costs ``2*hidden*vocab`` per block token, so 3x forward over-counts it by a third
     of its share; that is within the approximation.
   * The drafter attends to the context (``ctx``) plus its own block, for ``anchors*block_size`` block tokens
     per sequence. It trains a batch in micro-batches (``train.drafter_step``), which splits the work without
     changing it; with ``checkpoint_layers`` its layers run their forward twice (4x forward instead of 3x).
   * ``qwen3.6-27b`` is Qwen3.6-27B-shaped: dense layers of this shape. Its hybrid (linear + full) attention
     is ignored, every layer being counted as full attention, which over-estimates its attention cost.
   * Stage time is FLOPs divided by a sustained rate (``tflops``); memory-bound kernels are not modelled.

3. **The paper projection**: per link (PCIe, NVLink), the time to move a batch's features to a drafter and
   its gradient running sum in and out, the fraction of drafter time that adds, and the best split of
   4 or 8 devices. Assumptions: all transfer is charged to the drafter side (features arrive there and the
   gradient sum lives there), transfers do not overlap compute, the loader is free (prefetched), weights are
   read once per step per drafter, and the optimizer reads and writes 16 bytes per drafter parameter
   (fp32 master weight, gradient, two Adam moments) at 4.8 TB/s of HBM bandwidth. One GB is 1e9 bytes.

4. **Scale-out across machines** (``scale_out``): K nodes, each at the per-node rate of part 3's best
   split, exchange the drafter's fp32 gradient sum once per optimizer step (``cluster``: a pipelined
   chain through the nodes, then a broadcast back, about ``2 * bytes / bandwidth`` plus one chunk per hop).
   The exchange sits on the step's critical path (the next step needs its weights), so a step takes
   ``compute + exchange``; one NIC's bandwidth per node carries it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Iterable

# ---------------------------------------------------------------------------------------------------------------
# 1. Throughput arithmetic
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageCosts:
    loader_s: float      # per batch
    target_s: float      # per batch, one target actor
    drafter_s: float     # per batch, one drafter actor
    optimizer_s: float   # per optimizer step
    tokens_per_batch: float
    control_s: float = 0.0
    """Per step, the control plane's latency on the drafter chain (the last gradient's
    Done reaching the optimizer, the optimizer's commit reaching the drafters): zero for
    the compute bound, measured for advice."""


def _check_split(n: int, m: int, grad_accum: int) -> None:
    if n < 1 or m < 1 or grad_accum < 1:
        raise ValueError(f"need n >= 1 targets, m >= 1 drafters and grad_accum >= 1, got {n}, {m}, {grad_accum}")


def _rate(work: float, seconds: float) -> float:
    """``work / seconds``, where a stage that costs nothing never limits."""
    return math.inf if seconds <= 0 else work / seconds


def _stage_rates(c: StageCosts, n: int, m: int, grad_accum: int) -> dict[str, float]:
    """Batches/s each stage could sustain alone; dict order is the tie-break order of ``bottleneck``."""
    _check_split(n, m, grad_accum)
    per_step = grad_accum * m
    return {
        "loader": _rate(1.0, c.loader_s),
        "target": _rate(n, c.target_s),
        # one drafter's chain per step: g batches, then wait for the optimizer (synchronous training)
        "drafter": _rate(per_step, grad_accum * c.drafter_s + c.optimizer_s + c.control_s),
    }


def bound_batches_per_s(c: StageCosts, n: int, m: int, grad_accum: int) -> float:
    """Steady-state batches/s of the pipeline with ``n`` targets and ``m`` drafters: its slowest stage."""
    return min(_stage_rates(c, n, m, grad_accum).values())


def bound_tokens_per_s(c: StageCosts, n: int, m: int, grad_accum: int) -> float:
    return bound_batches_per_s(c, n, m, grad_accum) * c.tokens_per_batch


def lockstep_batches_per_s(c: StageCosts, n: int, m: int, grad_accum: int) -> float:
    """Batches/s of the old loop, whose stages ran one after another within each step."""
    _check_split(n, m, grad_accum)
    per_step = grad_accum * m
    step_s = (per_step * c.loader_s                       # one loader, serial
              + math.ceil(per_step / n) * c.target_s      # targets in parallel, in rounds of n
              + grad_accum * c.drafter_s                  # drafters in parallel, g batches each
              + c.optimizer_s)
    return _rate(per_step, step_s)


def lockstep_tokens_per_s(c: StageCosts, n: int, m: int, grad_accum: int) -> float:
    return lockstep_batches_per_s(c, n, m, grad_accum) * c.tokens_per_batch


def ideal_speedup(c: StageCosts, n: int, m: int, grad_accum: int) -> float:
    return bound_batches_per_s(c, n, m, grad_accum) / lockstep_batches_per_s(c, n, m, grad_accum)


def bottleneck(c: StageCosts, n: int, m: int, grad_accum: int) -> str:
    """``"loader"``, ``"target"`` or ``"drafter"`` (whose chain includes the optimizer); ties go left."""
    rates = _stage_rates(c, n, m, grad_accum)
    return min(rates, key=rates.__getitem__)


def gang_costs(c: StageCosts, tp: int) -> StageCosts:
    """Costs per target actor of ``tp`` devices (``topology.target_tp``), from ``c``'s
    one-device target: its forward split ``tp`` ways, the ideal that tensor parallelism
    approaches and never beats (its all-reduces are extra), so the bound stays a bound."""
    return c if tp == 1 else replace(c, target_s=c.target_s / tp)


def advise(c: StageCosts, devices: int, grad_accum: int, loader_bound: bool = True,
           tp: int = 1) -> list[tuple[int, int, float]]:
    """Every split ``n * tp + m == devices`` (``n`` targets of ``tp`` devices each, ``m``
    drafters) as ``(n, m, bound tokens/s)``, best first, fewer targets first on ties.

    ``loader_bound=False`` drops the loader from the bound, for a loader known to keep up (prefetched).
    """
    if devices < tp + 1:
        raise ValueError(f"topology needs at least {tp + 1} devices (one target of {tp}, one drafter), got {devices}")
    costs = gang_costs(c if loader_bound else replace(c, loader_s=0.0), tp)
    splits = [(n, devices - n * tp, bound_tokens_per_s(costs, n, devices - n * tp, grad_accum))
              for n in range(1, (devices - 1) // tp + 1)]
    return sorted(splits, key=lambda s: (-s[2], s[0]))


def explain(c: StageCosts, devices: int, grad_accum: int, tp: int = 1) -> str:
    """One line saying which split ``advise`` picks and why, for the launcher's log."""
    ranked = advise(c, devices, grad_accum, tp=tp)
    n, m, tok = ranked[0]
    gang = f"x{tp}" if tp > 1 else ""
    runner_up = f"next {ranked[1][0]}{gang}-{ranked[1][1]} at {ranked[1][2]:.0f} tokens/s" if len(ranked) > 1 \
        else "no other split"
    c = gang_costs(c, tp)
    return (f"topology auto: {n}{gang}-{m} for {devices} devices "
            f"(target {c.target_s * 1e3:.1f} ms/batch, drafter {c.drafter_s * 1e3:.1f} ms/batch "
            f"+ optimizer {c.optimizer_s * 1e3:.1f} ms/step"
            f"{f', target split {tp} ways at best' if tp > 1 else ''}"
            f"{f' + control {c.control_s * 1e3:.1f} ms/step' if c.control_s else ''}, grad_accum {grad_accum}: "
            f"bound {tok:.0f} tokens/s, {bottleneck(c, n, m, grad_accum)}-bound; {runner_up})")


# ---------------------------------------------------------------------------------------------------------------
# 2. Model shapes and FLOPs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def layer_params(self) -> int:
        """Weights of one decoder layer: attention projections and a gated MLP; norms ignored."""
        q = o = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate        # gate, up, down
        return q + kv + o + mlp


SHAPES = {
    "qwen3-8b": ModelShape("qwen3-8b", 4096, 36, 12288, 32, 8, 128, 151936),
    # an assumption (see the module docstring): dense layers of this shape, hybrid attention ignored
    "qwen3.6-27b": ModelShape("qwen3.6-27b", 5120, 64, 17408, 24, 4, 256, 248320),
}


@dataclass(frozen=True)
class Workload:
    token_budget: int = 65536      # target tokens per batch
    sequences_per_batch: int = 30  # packed sequences (about 2,200 tokens each)
    anchors: int = 512             # per sequence
    block_size: int = 16
    feature_layers: int = 5        # target layers feeding the drafter
    drafter_layers: int = 5
    feature_bytes: int = 2         # bf16 features
    grad_bytes: int = 4            # fp32 gradient sums and master weights
    checkpoint_layers: bool = False  # train.checkpoint_layers: the drafter's layers recomputed in the backward


def _mean_context(w: Workload) -> float:
    # causal attention over a packed sequence sees on average half of it
    return (w.token_budget / w.sequences_per_batch) / 2


def target_flops_per_batch(shape: ModelShape, w: Workload) -> float:
    """Forward FLOPs of the target over one batch, LM head excluded."""
    tokens = w.token_budget
    matmuls = 2 * shape.layer_params() * shape.layers * tokens
    attention = 4 * shape.layers * shape.heads * shape.head_dim * _mean_context(w) * tokens
    return float(matmuls + attention)


def drafter_params(shape: ModelShape, w: Workload) -> int:
    """Trainable drafter weights: its layers and the feature projection (LM head and embeddings are frozen)."""
    return w.drafter_layers * shape.layer_params() + w.feature_layers * shape.hidden * shape.hidden


def drafter_flops_per_batch(shape: ModelShape, w: Workload) -> float:
    """Forward+backward FLOPs of the drafter over one batch, taken as 3x forward (its
    layers 4x with ``checkpoint_layers``)."""
    block_tokens = w.sequences_per_batch * w.anchors * w.block_size
    layers = 2 * w.drafter_layers * shape.layer_params() * block_tokens
    lm_head = 2 * shape.hidden * shape.vocab * block_tokens
    fc = 2 * w.feature_layers * shape.hidden * shape.hidden * w.token_budget   # runs on every target token
    attention = 4 * w.drafter_layers * shape.heads * shape.head_dim * (_mean_context(w) + w.block_size) * block_tokens
    recompute = layers + attention if w.checkpoint_layers else 0.0
    return 3.0 * (layers + lm_head + fc + attention) + recompute


def bytes_per_batch(shape: ModelShape, w: Workload) -> dict[str, int]:
    """Bytes a batch moves: features to the drafter, its gradient sum, and the weights (per step, not batch)."""
    params = drafter_params(shape, w)
    return {
        "features": w.token_budget * w.feature_layers * shape.hidden * w.feature_bytes,
        "gradients": 2 * params * w.grad_bytes,   # the running sum is read and written back per batch
        "weights": params * w.grad_bytes,         # read once per step per drafter
    }


def simulated_costs(target: ModelShape, w: Workload, tflops: float) -> tuple[float, float]:
    """``(target_s, drafter_s)`` per batch at ``tflops`` sustained TFLOP/s."""
    rate = tflops * 1e12
    return target_flops_per_batch(target, w) / rate, drafter_flops_per_batch(target, w) / rate


# ---------------------------------------------------------------------------------------------------------------
# 3. The paper projection
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    name: str
    gb_per_s: float


PCIE = Link("PCIe 5.0 x16", 50.0)
NVLINK = Link("NVLink (H200)", 400.0)

HBM_BYTES_PER_S = 4.8e12        # H200
OPTIMIZER_BYTES_PER_PARAM = 16  # fp32 master weight, gradient and two Adam moments, each read or written


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def default_optimizer_s(shape: ModelShape, w: Workload) -> float:
    return drafter_params(shape, w) * OPTIMIZER_BYTES_PER_PARAM / HBM_BYTES_PER_S


def transfer_s_per_batch(shape: ModelShape, w: Workload, link: Link, grad_accum: int = 1) -> float:
    """Link time per batch: features and gradient sum every batch, the weights once per ``grad_accum`` batches."""
    b = bytes_per_batch(shape, w)
    return (b["features"] + b["gradients"] + b["weights"] / grad_accum) / (link.gb_per_s * 1e9)


def _best_splits(costs: StageCosts, devices: Iterable[int], grad_accum: int) -> dict[str, dict]:
    out = {}
    for count in devices:
        n, m, tok = advise(costs, count, grad_accum)[0]
        out[str(count)] = {"best": f"{n}-{m}", "tokens_per_s": _sig(tok),
                           "bottleneck": bottleneck(costs, n, m, grad_accum)}
    return out


def project(shape: ModelShape, w: Workload, tflops: float, links: Iterable[Link] = (PCIE, NVLINK),
            devices: Iterable[int] = (4, 8), grad_accum: int = 1, optimizer_s: float | None = None) -> dict:
    """The projection as a JSON-able dict; keys: model, assumptions, target_s, drafter_s, optimizer_s,
    drafter_params, bytes_per_batch_gb, no_transfer (best splits with free links) and links (per link name:
    gb_per_s, transfer_s, overhead_fraction, topologies: per device count best "n-m", tokens_per_s, bottleneck).
    """
    target_s, drafter_s = simulated_costs(shape, w, tflops)
    opt_s = default_optimizer_s(shape, w) if optimizer_s is None else optimizer_s
    devices = tuple(devices)
    base = StageCosts(0.0, target_s, drafter_s, opt_s, w.token_budget)   # loader prefetched: never limits
    per_link = {}
    for link in links:
        xfer = transfer_s_per_batch(shape, w, link, grad_accum)
        per_link[link.name] = {
            "gb_per_s": link.gb_per_s,
            "transfer_s": _sig(xfer),
            # all traffic is charged to the drafter side, where the features land and the gradient sum lives
            "overhead_fraction": _sig(xfer / (xfer + drafter_s)),
            "topologies": _best_splits(replace(base, drafter_s=drafter_s + xfer), devices, grad_accum),
        }
    return {
        "model": shape.name,
        "assumptions": {"tflops": tflops, "grad_accum": grad_accum, "hbm_bytes_per_s": HBM_BYTES_PER_S,
                        "workload": {f.name: getattr(w, f.name) for f in fields(w)},
                        "links_gb_per_s": {link: v["gb_per_s"] for link, v in per_link.items()}},
        "target_s": _sig(target_s), "drafter_s": _sig(drafter_s), "optimizer_s": _sig(opt_s),
        "drafter_params": drafter_params(shape, w),
        "bytes_per_batch_gb": {k: _sig(v / 1e9) for k, v in bytes_per_batch(shape, w).items()},
        "no_transfer": _best_splits(base, devices, grad_accum),
        "links": per_link,
    }


# ---------------------------------------------------------------------------------------------------------------
# 4. Scale-out across machines
# ---------------------------------------------------------------------------------------------------------------

INTERCONNECTS = (Link("InfiniBand NDR 400 Gb/s", 50.0), Link("InfiniBand HDR 200 Gb/s", 25.0),
                 Link("100 GbE", 12.5), Link("25 GbE", 3.125))
CHAIN_CHUNK_BYTES = 16 * 2 ** 20      # cluster.CHUNK floats of 4 bytes
HOP_LATENCY_S = 20e-6


def exchange_s(params: int, nodes: int, link: Link, grad_bytes: int = 4) -> float:
    """One step's cross-node exchange: the chain (one transfer, plus a chunk per extra hop) and the broadcast."""
    if nodes == 1:
        return 0.0
    size, bw = params * grad_bytes, link.gb_per_s * 1e9
    chain = (size + (nodes - 2) * min(size, CHAIN_CHUNK_BYTES)) / bw
    broadcast = size / bw + math.ceil(math.log2(nodes)) * HOP_LATENCY_S
    return chain + broadcast + nodes * HOP_LATENCY_S


def scale_out(shape: ModelShape, w: Workload, node_tokens_per_s: float, batches_per_node_step: int,
              links: Iterable[Link] = INTERCONNECTS, nodes: Iterable[int] = (1, 2, 4, 8)) -> dict:
    """Throughput at K nodes, per interconnect: ``{link: {K: {tokens_per_s, efficiency, exchange_s}}}``
    plus the step's compute time; ``batches_per_node_step`` = grad_accum * drafters per node."""
    params = drafter_params(shape, w)
    compute = batches_per_node_step * w.token_budget / node_tokens_per_s
    out = {}
    for link in links:
        row = {}
        for k in nodes:
            x = exchange_s(params, k, link, w.grad_bytes)
            rate = k * batches_per_node_step * w.token_budget / (compute + x)
            row[str(k)] = {"tokens_per_s": _sig(rate), "efficiency": _sig(rate / (k * node_tokens_per_s), 3),
                           "exchange_s": _sig(x, 3)}
        out[link.name] = row
    return {"model": shape.name, "drafter_params": params, "node_tokens_per_s": _sig(node_tokens_per_s),
            "batches_per_node_step": batches_per_node_step, "step_compute_s": _sig(compute, 3), "links": out}
