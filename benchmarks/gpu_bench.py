"""What ``benchmarks/gpu_check.sh`` measures on a lent GPU, one subcommand per section.

    python -m benchmarks.gpu_bench env            # versions, device, /dev/shm, disk
    python -m benchmarks.gpu_bench prepare        # 2c's target saved, 2c's plan (2b and 2c read it)
    python -m benchmarks.gpu_bench tiny           # 3: tiny 2-2 over the CUDA feature ring vs the reference
    python -m benchmarks.gpu_bench nodes          # 3: two nodes over loopback
    python -m benchmarks.gpu_bench target         # 2a: target forward, Qwen3-8B shape, bf16
    python -m benchmarks.gpu_bench drafter        # 2b: drafter step at the memory plan's micro-batch
    python -m benchmarks.gpu_bench pipeline       # 2c: launch.py 1-1 on cuda:0, to steady steps
    python -m benchmarks.gpu_bench serving        # prepare --server against vLLM (skips without it)
    python -m benchmarks.gpu_bench collect WORK   # the final {"check": "gpu_check", ...} line

Each measuring subcommand prints one JSON line and, with ``--out FILE``, writes it there
too, rewritten as each part finishes: a section that runs out of time still leaves the
parts it finished. Launch logs and plans go to ``--work`` (``$WORK``). ``--smoke`` runs
the same code on CPU with tiny shapes (hidden 64, 6 layers, vocab 256, 2 x 64 tokens),
so that the paths are exercised where no GPU is; its numbers mean nothing.

Choices, and why:
  * 2a and 2b build Qwen3-8B-shaped modules directly on the device with random weights
    (nothing to download; seconds, not minutes): speed does not depend on the values.
  * 2b builds only the target's ``embed_tokens`` and ``lm_head`` (bf16, frozen, the
    modules ``TargetModel`` hands the loss) instead of the whole target, and trains
    through ``drafter_step`` at the micro-batch (``train.drafter_block_tokens``) and
    checkpointing that ``launch.py --plan-only`` chooses for the pipeline's run (2c) on
    this GPU: 2b is 2c's drafter step alone, and its peak memory is set beside the
    plan's for ``drafter.0``.
  * 2c is one run, sized to reach steady steps in about 200 s: the 8B-shaped 5-layer
    drafter of 2b (its compiled kernels are then warm), a target of Qwen3-8B's shape cut
    to ``PIPE_TARGET_LAYERS`` layers (7 GB instead of 16: quicker to save and load;
    the drafter's work does not depend on the target's depth), loaded by the target
    itself (``target.share_weights=off``: no 7 GB copy into /dev/shm), 4 threads an
    actor, and everything else as the plan places it (feature ring, optimizer): the
    product's own choices on this GPU. The CUDA feature ring across processes is
    ``tiny``'s to check. ``prepare`` saves the target and makes the plan while the
    first sections run, so that 2c's time goes to the run.
  * Where a run has a plan (tiny, 2b, 2c), each process's planned peak per device is set
    beside what it measured (``status.json``'s ``gpu_peak_mb``, ``max_memory_allocated``
    on its device; the plan's figure includes a CUDA context that this does not).
  * FLOPs come from ``costmodel`` (the counts the run summaries use for MFU): matmuls
    ``2 * weights * tokens``, causal attention over half a row on average, drafter
    forward+backward as 3x forward. The target counts only layers ``0..max(layer_ids)``:
    ``TargetModel.hidden`` stops the forward after the deepest selected layer. Recomputed
    work (checkpointed cross-entropy chunks or layers) is not counted, as usual for MFU.
  * MFU is achieved TFLOP/s over the device's bf16 dense peak (``monitor.PEAK_TFLOPS``;
    989 for an H200, also the fallback for a device not in that table). SpecForge
    reports about 44% trainer MFU on an H200; the drafter numbers are set beside it.
  * The pipeline's steady rate is read from ``metrics.jsonl``: tokens of the steps after
    the first two (start-up, flex_attention compilation) over the time they took. Run
    summaries' tokens/s divide by the whole wall time, model loading and the final
    checkpoint included, and are reported too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
GIB = 2 ** 30
SPECFORGE_MFU = 0.44
"""SpecForge's reported DFlash trainer MFU on an H200: the public anchor for 2b."""

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                max_position_embeddings=40960, tie_word_embeddings=False)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rope_theta=1e6, max_position_embeddings=4096,
            tie_word_embeddings=False)

PIPE_TARGET_LAYERS = 12
"""2c's target: Qwen3-8B's shape with this many layers (module docstring)."""
PIPE_TARGET_DIR = Path("/tmp/gpu-q8-12l")
PLAN_FILE = "pipeline_plan.json"
"""2c's plan, in the work folder: what 2b and 2c are sized by (``prepare``)."""
PIPE_SAMPLES = 400
"""Synthetic samples of 2c: 50 steps of 8, more than 200 s hold; the run is stopped by time
(``--smoke``: 80, which two CPU cores finish)."""
FALLBACK_BLOCK_TOKENS = 8192
"""2b's micro-batch should ``--plan-only`` fail: a step is still measured (and the failure reported)."""


@dataclass(frozen=True)
class Sizes:
    """One measurement's shapes and repetitions."""

    model: dict
    rows: int               # sequences per batch
    seq_len: int            # tokens per sequence
    draft_layers: int
    block_size: int
    num_anchors: int
    warmup: int
    runs: int


FULL = Sizes(QWEN3_8B, rows=8, seq_len=2048, draft_layers=5, block_size=16, num_anchors=512, warmup=1, runs=3)
SMOKE = Sizes(TINY, rows=2, seq_len=64, draft_layers=2, block_size=4, num_anchors=8, warmup=1, runs=2)


def say(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def _sig(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


def _gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else round(nbytes / GIB, 3)


def _mib_gib(mib: float | None) -> float | None:
    """status.json's MiB as GiB; None where the process reported none."""
    return round(mib / 1024, 3) if mib else None


def write_json(data: dict, path: str) -> None:
    """``data`` as one line in ``path``, whole (by rename): a reader never sees half of it."""
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def emit(result: dict, out: str | None) -> None:
    """Write ``result`` to ``out`` and print it as one line."""
    if out:
        write_json(result, out)
    print(json.dumps(result), flush=True)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


def read_json(path: Path) -> dict:
    """The JSON object in ``path``, or {} where it is missing or cut short."""
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            return data
    return {}


# ---------------------------------------------------------------------------
# FLOPs and MFU


def model_shape(model: dict, layers: int):
    from dflash_actors.train.costmodel import ModelShape

    return ModelShape("bench", model["hidden_size"], layers, model["intermediate_size"],
                      model["num_attention_heads"], model["num_key_value_heads"], model["head_dim"],
                      model["vocab_size"])


def target_flops(model: dict, layer_ids: list[int], rows: int, seq_len: int) -> float:
    """Forward FLOPs of ``TargetModel.hidden`` on ``[rows, seq_len]``: layers up to the
    deepest selected one, no embeddings, no final norm, no LM head (``costmodel``'s count)."""
    from dflash_actors.train.costmodel import Workload, target_flops_per_batch

    return target_flops_per_batch(model_shape(model, max(layer_ids) + 1),
                                  Workload(token_budget=rows * seq_len, sequences_per_batch=rows))


def drafter_flops(model: dict, feature_layers: int, draft_layers: int, rows: int, seq_len: int,
                  anchors_per_row: int, block_size: int) -> float:
    """Forward+backward FLOPs of one drafter step (``costmodel.drafter_flops_per_batch``):
    its layers over every block token, the frozen LM head over every block token, the
    ``fc`` over every target token, attention over the context and the block."""
    from dflash_actors.train.costmodel import Workload, drafter_flops_per_batch

    w = Workload(token_budget=rows * seq_len, sequences_per_batch=rows, anchors=anchors_per_row,
                 block_size=block_size, feature_layers=feature_layers, drafter_layers=draft_layers)
    return drafter_flops_per_batch(model_shape(model, model["num_hidden_layers"]), w)


def peak_tflops(device) -> float:
    """The device's bf16 dense peak from ``monitor.PEAK_TFLOPS``; an H200's where unknown (CPU)."""
    import torch

    from dflash_actors.observe.monitor import PEAK_TFLOPS

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for k, v in PEAK_TFLOPS.items():
            if k in name:
                return v
    return PEAK_TFLOPS["H200"]


def rates(flops: float, seconds: float, tokens: int, peak: float) -> dict:
    tflops = flops / seconds / 1e12
    return {"step_s": _sig(seconds), "tokens_per_s": _sig(tokens / seconds), "tflops": _sig(tflops),
            "peak_tflops": peak, "mfu": _sig(tflops / peak)}


# ---------------------------------------------------------------------------
# timing and memory


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, warmup: int, runs: int, device) -> list[float]:
    """Seconds of ``fn(i)`` for ``runs`` calls after ``warmup`` untimed ones (i counts all calls)."""
    for i in range(warmup):
        fn(i)
        sync(device)
    out = []
    for i in range(warmup, warmup + runs):
        t = time.perf_counter()
        fn(i)
        sync(device)
        out.append(time.perf_counter() - t)
    return out


def reset_memory(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def memory_gib(device) -> dict:
    """This process's CUDA memory on ``device`` (GiB): now and the peaks since the last
    reset, allocated and reserved; Nones on the CPU."""
    import torch

    if device.type != "cuda":
        return {"allocated_gib": None, "max_allocated_gib": None, "max_reserved_gib": None}
    return {"allocated_gib": _gib(torch.cuda.memory_allocated(device)),
            "max_allocated_gib": _gib(torch.cuda.max_memory_allocated(device)),
            "max_reserved_gib": _gib(torch.cuda.max_memory_reserved(device))}


@contextlib.contextmanager
def building_on(device, dtype):
    """Modules created inside get their parameters on ``device`` in ``dtype`` directly."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def setup(smoke: bool):
    import torch

    if smoke:
        torch.set_num_threads(1)
        return torch.device("cpu"), SMOKE
    return torch.device("cuda:0"), FULL


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ---------------------------------------------------------------------------
# plans: launch.py --plan-only beside what the processes measured


def with_sets(cmd: list[str], sets: list[str]) -> list[str]:
    for s in sets:
        cmd = cmd + ["--set", s]
    return cmd


def plan_only(topology: str, sets: list[str], log: Path, timeout_s: float = 180.0) -> dict:
    """``launch.py --plan-only --json`` for a launch of ``topology`` with these ``--set``s:
    the memory plan that launch resolves before it spawns (``problem`` set where a device
    does not fit), or ``{"error": ...}``. Its output goes to ``log``."""
    cmd = with_sets([sys.executable, "launch.py", "--plan-only", "--json", "--topology", topology], sets)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"launch.py --plan-only timed out after {timeout_s:.0f} s"}
    log.write_text(proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    with contextlib.suppress(ValueError, IndexError):
        plan = json.loads(lines[-1])
        if isinstance(plan, dict):
            return plan
    return {"error": f"launch.py --plan-only exit {proc.returncode}: {last_error(log)}"}


def step_part(plan: dict, process: str = "drafter.0") -> dict:
    """The plan's part for ``process``'s drafter step at its peak (traced), or {}."""
    for dev in plan.get("memory_plan") or []:
        for p in dev["parts"]:
            if p["process"] == process and p["key"] == "train.drafter_block_tokens":
                return {"device": dev["device"], **p}
    return {}


def plan_brief(plan: dict) -> dict:
    """What the plan decided, for the section's line (the whole plan is in its log)."""
    out = {k: plan.get(k) for k in ("drafter_block_tokens", "checkpoint_layers", "optimizer_device",
                                    "feature_device", "problem")}
    if plan.get("error"):
        out["error"] = plan["error"]
    out["drafter_step_peak_gib"] = step_part(plan).get("gib")
    return out


def planned(plan: dict, process: str, device: str) -> tuple[float | None, float | None]:
    """``(GiB, of which CUDA context GiB)`` the plan gives ``process`` on ``device``."""
    total = next((p["gib"] for p in plan.get("processes") or [] if (p["process"], p["device"]) == (process, device)),
                 None)
    context = None
    for dev in plan.get("memory_plan") or []:
        if dev["device"] == device:
            context = sum(p["gib"] for p in dev["parts"] if p["process"] == process and p["what"] == "CUDA context")
    return total, context or None


def plan_vs_measured(plan: dict, status: dict) -> list[dict]:
    """One row per process and device of the plan: its planned peak (a CUDA context
    included, ``context_gib`` of it) beside the peaks the process reported in
    ``status.json`` (allocated and reserved on its current device, which is the planned
    GPU in these one-GPU runs; null on the host, which no process reports); then a row
    for each process that allocated GPU memory the plan did not give it."""
    processes = {"supervisor": status.get("supervisor") or {}, **(status.get("actors") or {})}
    rows, on_gpu = [], set()
    for p in plan.get("processes") or []:
        st = processes.get(p["process"])
        gpu = p["device"].startswith("cuda") and st is not None
        if gpu:
            on_gpu.add(p["process"])
        rows.append({"process": p["process"], "device": p["device"], "planned_gib": p["gib"],
                     "context_gib": planned(plan, p["process"], p["device"])[1],
                     "measured_peak_gib": _mib_gib(st.get("gpu_peak_mb")) if gpu else None,
                     "reserved_peak_gib": _mib_gib(st.get("gpu_reserved_peak_mb")) if gpu else None})
    for name, st in processes.items():
        if name not in on_gpu and st.get("gpu_peak_mb"):
            rows.append({"process": name, "device": "cuda, not planned", "planned_gib": None, "context_gib": None,
                         "measured_peak_gib": _mib_gib(st["gpu_peak_mb"]),
                         "reserved_peak_gib": _mib_gib(st.get("gpu_reserved_peak_mb"))})
    return rows


# ---------------------------------------------------------------------------
# 2a: the target forward


def build_target(model: dict, draft_layers: int, device):
    """A random-weight Qwen3 of shape ``model`` wrapped as the product's ``TargetModel``,
    in the dtype the product loads targets in (bf16 on CUDA, float32 on CPU)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_actors.models.target import TargetModel, build_target_layer_ids, resolve_dtype

    config = Qwen3Config(**model, attn_implementation="sdpa")
    with building_on(device, resolve_dtype("auto", device)):
        lm = Qwen3ForCausalLM(config)
    return TargetModel(lm, build_target_layer_ids(model["num_hidden_layers"], draft_layers))


def bench_target(sizes: Sizes, device, out: str | None = None) -> dict:
    import torch

    reset_memory(device)
    t = time.perf_counter()
    target = build_target(sizes.model, sizes.draft_layers, device)
    sync(device)
    tokens = sizes.rows * sizes.seq_len
    result = {"section": "target", "device": device_name(device), "dtype": str(target.dtype).removeprefix("torch."),
              "shape": "smoke" if sizes is SMOKE else "qwen3-8b", "layer_ids": target.layer_ids,
              "layers_run": max(target.layer_ids) + 1, "batch": [sizes.rows, sizes.seq_len], "tokens": tokens,
              "build_s": _sig(time.perf_counter() - t, 3)}
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, sizes.model["vocab_size"], (sizes.rows, sizes.seq_len), device=device, generator=g)
    last = []

    def forward(_i):
        last[:] = [target.hidden(ids)]

    try:
        times = timed(forward, sizes.warmup, sizes.runs, device)
        flops = target_flops(sizes.model, target.layer_ids, sizes.rows, sizes.seq_len)
        result.update(times_s=[_sig(x) for x in times], flops_per_batch=_sig(flops),
                      **rates(flops, statistics.median(times), tokens, peak_tflops(device)),
                      features_finite=bool(torch.isfinite(last[0]).all()))
    except Exception as e:  # noqa: BLE001 - an OOM is a result to record
        result["error"] = first_line(e)
    result["max_allocated_gib"] = memory_gib(device)["max_allocated_gib"]
    emit(result, out)
    return result


def save_model(model, path: Path) -> None:
    """``save_pretrained`` (safetensors) under a temporary name, then renamed: a save the
    time limit cuts short leaves no directory a later section would try to load."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(tmp)
    os.replace(tmp, path)


def _build_and_save_pipe_target(path: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with building_on(torch.device("cuda:0"), torch.bfloat16):
        lm = Qwen3ForCausalLM(Qwen3Config(**{**QWEN3_8B, "num_hidden_layers": PIPE_TARGET_LAYERS}))
    save_model(lm, Path(path))


def save_pipe_target(path: Path) -> float:
    """2c's random bf16 target saved at ``path`` unless it is there; built on cuda:0 in a
    child process, so that this one holds no GPU memory while the launch runs. Seconds."""
    if (path / "config.json").is_file():
        return 0.0
    t = time.perf_counter()
    p = multiprocessing.get_context("spawn").Process(target=_build_and_save_pipe_target, args=(str(path),))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"building and saving the pipeline's target exited {p.exitcode} (its traceback is above)")
    return round(time.perf_counter() - t, 1)


# ---------------------------------------------------------------------------
# 2b: the drafter train step


def build_drafter_step(sizes: Sizes, device):
    """``(drafter, head, features, batch, layer_ids)`` for one product train step: a
    freshly initialised drafter, the frozen embeddings and LM head, random target
    features ``[T, k*H]`` and a packed batch of random tokens, every position supervised."""
    import torch
    from torch import nn
    from transformers import Qwen3Config

    from dflash_actors.data.batching import Batch
    from dflash_actors.models.drafter import DFlashDrafter, drafter_config
    from dflash_actors.models.target import build_target_layer_ids, resolve_dtype

    m = sizes.model
    vocab, hidden = m["vocab_size"], m["hidden_size"]
    layer_ids = build_target_layer_ids(m["num_hidden_layers"], sizes.draft_layers)
    mask_id = vocab - 1
    cfg = drafter_config(Qwen3Config(**m), sizes.draft_layers, sizes.block_size, layer_ids, mask_id, "bench", vocab)
    # fp32 master weights, as build_drafter makes them; initialised in place on the
    # device (build_drafter's seeded CPU init of 1e9 weights would take longer than the step)
    with building_on(device, torch.float32):
        drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, cfg.initializer_range)
    tdtype = resolve_dtype("auto", device)
    with building_on(device, tdtype):
        head = SimpleNamespace(embed_tokens=nn.Embedding(vocab, hidden).requires_grad_(False),
                               lm_head=nn.Linear(hidden, vocab, bias=False).requires_grad_(False))
        for mod in (head.embed_tokens, head.lm_head):
            nn.init.normal_(mod.weight, 0.0, cfg.initializer_range)
    g = torch.Generator(device=device).manual_seed(1)
    T, n = sizes.rows * sizes.seq_len, sizes.seq_len
    features = torch.randn(T, len(layer_ids) * hidden, device=device, dtype=tdtype, generator=g)
    batch = Batch(input_ids=torch.randint(0, vocab - 1, (T,), device=device, generator=g),
                  position_ids=torch.arange(n, device=device).repeat(sizes.rows),
                  loss_mask=torch.ones(T, dtype=torch.int8, device=device),
                  cu_seqlens=torch.arange(0, T + 1, n, dtype=torch.int32, device=device), max_len=n)
    return drafter, head, features, batch, layer_ids


def train_step(drafter, head, features, batch, objective, block_tokens: int | None, checkpoint_layers: bool,
               stats: dict):
    """``step(i)``: the drafter actor's work on batch i of a one-batch step
    (``drafter_step`` into fresh gradients); the last loss and block count go into ``stats``."""
    from dflash_actors.train.drafter_step import drafter_step

    params = list(drafter.parameters())

    def step(i: int) -> None:
        for p in params:
            p.grad = None
        st = drafter_step(drafter, head, features, batch, objective, epoch=0, batch_id=i, block_tokens=block_tokens,
                          checkpoint_layers=checkpoint_layers)
        stats.update(loss=st.metrics()["loss"], blocks=st.blocks)
    return step


def micro_batches(batch, objective, block_size: int, block_tokens: int | None) -> int:
    """How many micro-batches ``drafter_step`` splits batch 0 into."""
    from dflash_actors.models.loss import batch_anchors
    from dflash_actors.train.drafter_step import split_anchors

    anchors = batch_anchors(batch, objective.num_anchors, objective.seed, 0, 0)
    lengths = [e - s for s, e in batch.sequences()]
    return sum(1 for g in split_anchors(lengths, anchors, block_size, block_tokens) if any(len(a) for a in g))


def bench_drafter(sizes: Sizes, device, plan: dict, out: str | None = None) -> dict:
    """2b at the micro-batch and checkpointing ``plan`` (2c's) chooses; its peak memory
    beside the plan's for ``drafter.0``, whose parts this process holds too (weights,
    gradients, head, the batch's features, the step) but for the CUDA context."""
    from dflash_actors.models.loss import Objective

    result = {"section": "drafter", "device": device_name(device),
              "shape": "smoke" if sizes is SMOKE else "qwen3-8b", "draft_layers": sizes.draft_layers,
              "block_size": sizes.block_size, "num_anchors": sizes.num_anchors,
              "batch": [sizes.rows, sizes.seq_len], "tokens": sizes.rows * sizes.seq_len,
              "specforge_mfu": SPECFORGE_MFU, "plan": plan_brief(plan)}
    if "drafter_block_tokens" in plan:
        block_tokens, ckpt = plan["drafter_block_tokens"], bool(plan.get("checkpoint_layers"))
    else:
        block_tokens, ckpt = FALLBACK_BLOCK_TOKENS, False
        result["error"] = f"no plan ({plan.get('error')}): measured at {FALLBACK_BLOCK_TOKENS} block tokens"
    objective = Objective(sizes.num_anchors, 7.0, 0, "auto")
    reset_memory(device)
    drafter, head, features, batch, layer_ids = build_drafter_step(sizes, device)
    params = sum(p.numel() for p in drafter.parameters())
    before = memory_gib(device)["allocated_gib"]
    result.update(layer_ids=layer_ids, params=params, block_tokens=block_tokens, checkpoint_layers=ckpt,
                  micro_batches=micro_batches(batch, objective, sizes.block_size, block_tokens))
    emit(result, out)
    stats: dict = {}
    step = train_step(drafter, head, features, batch, objective, block_tokens, ckpt, stats)
    try:
        times = timed(step, sizes.warmup, sizes.runs, device)
        anchors = max(1, round(stats["blocks"] / sizes.rows))
        flops = drafter_flops(sizes.model, len(layer_ids), sizes.draft_layers, sizes.rows, sizes.seq_len,
                              anchors, sizes.block_size)
        result.update(times_s=[_sig(x) for x in times], anchors_per_row=anchors, flops_per_batch=_sig(flops),
                      **rates(flops, statistics.median(times), result["tokens"], peak_tflops(device)),
                      loss=_sig(stats["loss"]))
        result["mfu_over_specforge"] = _sig(result["mfu"] / SPECFORGE_MFU, 3)
    except Exception as e:  # noqa: BLE001 - an OOM or a compile failure is a result to record
        result["error"] = first_line(e)
        say(f"drafter: {first_line(e)}")
    mem = memory_gib(device)
    total, context = planned(plan, "drafter.0", str(device))
    # The traced step peak leaves out weights, gradients and inputs (memtrace.StepTrace).
    step_peak = None if before is None or mem["max_allocated_gib"] is None else \
        round(mem["max_allocated_gib"] - before - params * 4 / GIB, 3)
    result["memory"] = {"before_step_gib": before, **{k: mem[k] for k in ("max_allocated_gib", "max_reserved_gib")},
                        "step_peak_gib": step_peak, "planned_step_peak_gib": step_part(plan).get("gib"),
                        "planned_gib": total, "planned_context_gib": context}
    result["plan_vs_measured"] = [{"process": "drafter.0", "device": str(device), "planned_gib": total,
                                   "context_gib": context, "measured_peak_gib": mem["max_allocated_gib"],
                                   "reserved_peak_gib": mem["max_reserved_gib"]}]
    emit(result, out)
    return result


# ---------------------------------------------------------------------------
# 2c: the real pipeline, 1-1 on one GPU


def pipeline_sets(target_dir: Path | None, device: str, smoke: bool) -> list[str]:
    """``--set`` overrides of 2c (and of 2b's plan): the cut 8B-shaped target loaded by
    the target actor, a 5-layer drafter, 8 x ~2048-token batches of synthetic data (one
    a step), no evaluation, a hang timeout past the first batch's compilation, and 4
    threads an actor (16 cores, four actors: the plan may put the optimizer's AdamW
    over 1e9 parameters on the host)."""
    sets = [f"topology.target_devices=[{device}]", f"topology.drafter_devices=[{device}]",
            "train.epochs=1", "train.checkpoint_every=0", "eval.every=0", "runtime.hang_timeout_s=300",
            "monitor.console=lines", "monitor.tensorboard=false", "data.synthetic.heldout_samples=0",
            f"data.synthetic.num_samples={80 if smoke else PIPE_SAMPLES}"]
    if target_dir is not None:
        sets.append(f"target.path={target_dir}")
    # A cache of its own: ``prepare`` makes the data while other sections fill theirs.
    if smoke:
        return sets + ["data.cache_dir=/tmp/gpu-bench-smoke-cache-pipe"]
    return sets + ["target.share_weights=off", "train.num_threads=4", "drafter.num_layers=5", "drafter.block_size=16",
                   "batching.token_budget=16384", "data.max_seq_len=2048", "train.num_anchors=512",
                   "data.synthetic.prompt_len=[64, 128]", "data.synthetic.completion_len=[1920, 1984]",
                   "data.cache_dir=/tmp/gpu-cache-pipe"]


def prepare(work: Path, smoke: bool, out: str | None = None) -> dict:
    """2c's target saved and 2c's plan made (``launch.py --plan-only`` with 2c's very
    settings), each unless done already: gpu_check.sh runs this beside the first
    sections, and 2b and 2c call it again to read the plan. Returns the plan (or
    ``{"error": ...}``), which also goes to ``work/PLAN_FILE``."""
    plan = read_json(work / PLAN_FILE)
    if plan:
        return plan
    result: dict = {"section": "prepare"}
    target_dir = None
    if not smoke:
        try:
            result["target_save_s"] = save_pipe_target(PIPE_TARGET_DIR)
        except Exception as e:  # noqa: BLE001 - recorded; 2b still measures, 2c cannot launch
            result["error"] = first_line(e)
            emit(result, out)
            return {"error": result["error"]}
        target_dir = PIPE_TARGET_DIR
    t = time.perf_counter()
    plan = plan_only("1-1", pipeline_sets(target_dir, "cpu" if smoke else "cuda:0", smoke), work / "pipeline_plan.log")
    result.update(plan_s=round(time.perf_counter() - t, 1), plan=plan_brief(plan))
    if "error" in plan:
        result["error"] = plan["error"]
    else:
        write_json(plan, str(work / PLAN_FILE))
    emit(result, out)
    return plan


def run_launch(cmd: list[str], log: Path, limit_s: float, grace_s: float) -> tuple[int, bool]:
    """Run ``cmd`` (a launch) with its output in ``log``; at ``limit_s - grace_s`` send it
    SIGTERM (it checkpoints, writes its summary and stops), at ``limit_s`` SIGKILL (its
    actors die with it). Same process group as ours, so an outer ``timeout`` reaches it.
    Returns ``(exit code, timed out)``."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=max(1.0, limit_s - grace_s)), False
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return proc.returncode, True


def read_jsonl(path: Path, kind: str) -> list[dict]:
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if rec.get("kind") == kind:
                    out.append(rec)
    return out


def steady(steps: list[dict], skip: int = 2) -> dict:
    """Rate over the steps after the first ``skip`` (fewer when the run had few): their
    tokens over the time from the end of the last skipped step to the end of the last
    one, and each stage's busy seconds in them. A resumed run logs some steps twice;
    the later line counts."""
    by_step = {}
    for s in steps:
        by_step[s["step"]] = s
    steps = [by_step[k] for k in sorted(by_step)]
    if len(steps) < 2:
        return {}
    skip = max(1, min(skip, len(steps) - 1))
    base, counted = steps[skip - 1], steps[skip:]
    span = counted[-1]["time"] - base["time"]
    if span <= 0:
        return {}
    tokens = sum(s["tokens"] for s in counted)
    busy: dict[str, float] = {}
    for s in counted:
        for role, st in (s.get("stages") or {}).items():
            busy[role] = busy.get(role, 0.0) + (st.get("busy_s") or 0.0)
    return {"steps": len(counted), "skipped_steps": skip, "tokens": tokens, "seconds": round(span, 3),
            "tokens_per_s": _sig(tokens / span), "step_s": _sig(span / len(counted)),
            "busy_s": {k: round(v, 3) for k, v in busy.items()}}


def stage_view(summary: dict, rate: dict) -> dict:
    """Per stage: the summary's busy fraction, TFLOP/s and MFU (over the whole run), and
    the MFU over the steady steps alone. The latter assumes FLOPs proportional to tokens
    (the batches are alike here): MFU x (busy s per token, whole run) / (busy s per token, steady)."""
    out = {}
    total_tokens = summary.get("tokens") or 0
    for role, st in (summary.get("stages") or {}).items():
        row = {k: st.get(k) for k in ("busy_fraction", "tokens_per_s", "tflops", "mfu")}
        busy_steady = (rate.get("busy_s") or {}).get(role)
        if st.get("mfu") and busy_steady and total_tokens and st.get("busy_s"):
            per_token_all = st["busy_s"] / total_tokens
            per_token_steady = busy_steady / rate["tokens"]
            row["steady_mfu"] = _sig(st["mfu"] * per_token_all / per_token_steady)
        out[role] = row
    return out


def last_error(log: Path, lines: int = 60) -> str | None:
    """The last line of ``log`` that reads like an error, else its last non-empty line."""
    if not log.is_file():
        return None
    text = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    pat = re.compile(r"error|Error|Exception|FAILED|Traceback|Killed|refused|not found|No such")
    for x in reversed(text[-lines:]):
        if pat.search(x):
            return x[:400]
    return text[-1][:400] if text else None


def planned_block_tokens(run_dir: Path):
    """``train.drafter_block_tokens`` as the run resolved it (its config.yaml), or None."""
    import yaml

    with contextlib.suppress(OSError, ValueError, AttributeError, yaml.YAMLError):
        return ((yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("train") or {}).get(
            "drafter_block_tokens")
    return None


def bench_pipeline(run_dir: Path, work: Path, limit_s: float, smoke: bool, out: str | None = None) -> dict:
    """2c: the launch, with what is left of ``limit_s`` once ``prepare`` has (had) its way."""
    end = time.monotonic() + limit_s
    device = "cpu" if smoke else "cuda:0"
    result: dict = {"section": "pipeline", "topology": "1-1",
                    "target": "tiny default" if smoke else f"qwen3-8b shape, {PIPE_TARGET_LAYERS} layers"}
    plan = prepare(work, smoke)
    sets = pipeline_sets(None if smoke else PIPE_TARGET_DIR, device, smoke)
    result["plan"] = plan_brief(plan)
    if plan.get("problem") or plan.get("error"):
        result["error"] = f"plan: {plan.get('problem') or plan.get('error')}"
        emit(result, out)
        return result
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = with_sets([sys.executable, "launch.py", "--topology", "1-1", "--run-dir", str(run_dir)], sets)
    left = end - time.monotonic()
    t = time.perf_counter()
    # The grace covers the final checkpoint (~12 GB) before the summary is written.
    rc, timed_out = run_launch(cmd, work / "pipeline_launch.log", left, grace_s=min(45.0, left / 4))
    result.update(rc=rc, timed_out=timed_out, wall_s=round(time.perf_counter() - t, 1))
    summary = read_json(run_dir / "summary.json")
    rate = steady(read_jsonl(run_dir / "metrics.jsonl", "step"))
    result.update(result_reason=summary.get("result"), steps=summary.get("step"),
                  total_steps=summary.get("total_steps"), loss=summary.get("loss"),
                  summary_tokens_per_s=summary.get("tokens_per_s"), summary_wall_s=summary.get("wall_s"),
                  restarts=summary.get("restarts"), steady=rate, tokens_per_s=rate.get("tokens_per_s"),
                  stages=stage_view(summary, rate), run_block_tokens=planned_block_tokens(run_dir),
                  plan_vs_measured=plan_vs_measured(plan, read_json(run_dir / "status.json")))
    # Stopped by time, the run is still a success here once it has steady steps.
    if rc != 0 and not (timed_out and rate):
        result["error"] = (f"timed out after {left:.0f} s; " if timed_out else f"exit {rc}; ") + \
            (last_error(work / "pipeline_launch.log") or "no output")
    # A checkpoint of this drafter is ~12 GB (weights and AdamW moments) of the lent machine's disk.
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    emit(result, out)
    return result


# ---------------------------------------------------------------------------
# 3: tiny models on CUDA: 2-2 against the reference, the monitor's view, two nodes


def tiny_sets(smoke: bool) -> list[str]:
    """The default config for one epoch of 256 samples (17 steps: what is checked is the
    data plane and the result, which fewer steps show as well, and in less time)."""
    return ["train.epochs=1", "monitor.console=lines", "monitor.tensorboard=false", "data.synthetic.num_samples=256",
            "data.cache_dir=/tmp/gpu-bench-smoke-cache" if smoke else "data.cache_dir=/tmp/gpu-cache"]


def devices_sets(device: str, n: int) -> list[str]:
    devs = ", ".join([device] * n)
    return [f"topology.target_devices=[{devs}]", f"topology.drafter_devices=[{devs}]"]


def bench_tiny(work: Path, limit_s: float, smoke: bool, out: str | None = None) -> dict:
    """The tiny default target 2-2 (all on one device; on a GPU the feature ring is there
    too, shared by CUDA IPC) and the single-process reference, side by side; equal within
    tolerance on CUDA (not bits); each process's memory beside its plan."""
    end = time.monotonic() + limit_s
    device = "cpu" if smoke else "cuda:0"
    run, ref = Path("/tmp/gpu-2-2"), Path("/tmp/gpu-ref")
    for d in (run, ref):
        shutil.rmtree(d, ignore_errors=True)
    sets = tiny_sets(smoke)
    plan = plan_only("2-2", sets + devices_sets(device, 2), work / "tiny_plan.log")
    result = {"section": "tiny", "plan": plan_brief(plan)}
    cmds = {"pipeline_2_2": with_sets([sys.executable, "launch.py", "--topology", "2-2", "--run-dir", str(run)],
                                      sets + devices_sets(device, 2)),
            "reference_2_2": with_sets([sys.executable, "launch.py", "reference", "--topology", "2-2",
                                        "--run-dir", str(ref)], sets)}
    procs = {k: subprocess.Popen(c, cwd=ROOT, stdout=open(work / f"tiny_{k}.log", "w"), stderr=subprocess.STDOUT)
             for k, c in cmds.items()}
    for k, p in procs.items():
        try:
            result[f"{k}_rc"] = p.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            result[f"{k}_rc"] = p.wait()
            result.setdefault("error", f"{k} timed out after {limit_s:.0f} s")
    summary, reference = read_json(run / "summary.json"), read_json(ref / "reference.json")
    losses = []
    with contextlib.suppress(OSError, ValueError):
        losses = json.loads((run / "losses.json").read_text())
    a, b = (losses[-1] if losses else None), reference.get("final_loss")
    rel = abs(a - b) / max(abs(b), 1e-12) if a is not None and b is not None else None
    result.update(steps=summary.get("step"), final_loss=a, reference_final_loss=b, rel_diff=_sig(rel),
                  match=rel is not None and rel < 2e-2, tokens_per_s=summary.get("tokens_per_s"),
                  reference_tokens_per_s=reference.get("tokens_per_s"))
    result["stages"] = {k: v for k, v in (summary.get("stages") or {}).items() if k in ("target", "drafter")}
    result["plan_vs_measured"] = plan_vs_measured(plan, read_json(run / "status.json"))
    for k in procs:
        if result[f"{k}_rc"] != 0:
            result.setdefault("error", f"{k} exit {result[f'{k}_rc']}: {last_error(work / f'tiny_{k}.log')}")
    emit(result, out)
    return result


def bench_nodes(work: Path, limit_s: float, smoke: bool, out: str | None = None) -> dict:
    """Two nodes on this machine (loopback), each 1-1 on one device, the gradient chain
    over gloo from host memory (NCCL refuses two ranks on one GPU): both must finish
    with identical replicas and the exchange time in their summaries."""
    import random

    device = "cpu" if smoke else "cuda:0"
    run = Path("/tmp/gpu-nodes")
    shutil.rmtree(run, ignore_errors=True)
    port = 29500 + random.randrange(1000)
    sets = tiny_sets(smoke) + devices_sets(device, 1) + ["runtime.collective_backend=gloo"]
    procs = []
    for r in (0, 1):
        cmd = with_sets([sys.executable, "launch.py", "--topology", "1-1", "--run-dir", str(run), "--nnodes", "2",
                         "--node-rank", str(r), "--master", f"127.0.0.1:{port}"], sets)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=open(work / f"nodes_{r}.log", "w"),
                                      stderr=subprocess.STDOUT))
    deadline = time.monotonic() + limit_s
    result = {"section": "nodes", "rc": []}
    for p in procs:
        try:
            result["rc"].append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            result["rc"].append(p.wait())
            result.setdefault("error", f"timed out after {limit_s:.0f} s")
    clusters = []
    for r in (0, 1):
        for line in (work / f"nodes_{r}.log").read_text(errors="replace").splitlines():
            if '"cluster"' in line:
                with contextlib.suppress(ValueError):
                    clusters.append(json.loads(line)["cluster"])
    result["cluster"] = clusters
    for r, rc in enumerate(result["rc"]):
        if rc != 0:
            result.setdefault("error", f"node {r} exit {rc}: {last_error(work / f'nodes_{r}.log')}")
    emit(result, out)
    return result


# ---------------------------------------------------------------------------
# serving, the environment, and the final line


def bench_serving(work: Path, limit_s: float, out: str | None = None) -> dict:
    """``prepare --server`` against a real vLLM on this machine, when vLLM is installed
    (nothing is downloaded): the tiny chat target served on cuda:0, 16 prompts through
    the token-id path; records the path taken, rows and tokens/s. Skipped without vLLM."""
    import importlib.util
    import urllib.request

    result: dict = {"section": "serving"}
    if importlib.util.find_spec("vllm") is None:
        result["skipped"] = "vllm is not installed on this machine"
        emit(result, out)
        return result
    from dflash_actors.config import load_config
    from dflash_actors.models.target import ensure_target
    from tests.support.chat import tiny_chat_target

    work = Path("/tmp/gpu-serving")
    shutil.rmtree(work, ignore_errors=True)
    cfg = load_config(ROOT / "configs/default.yaml", [f"data.cache_dir={work / 'cache'}"])
    model = tiny_chat_target(ensure_target(cfg), work / "chat")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."}]}) + "\n"
                               for i in range(16)))
    port = 8000 + os.getpid() % 1000
    deadline = time.monotonic() + limit_s
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                               "--port", str(port), "--max-model-len", "512", "--gpu-memory-utilization", "0.3"],
                              stdout=open(work / "serving_vllm.log", "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        t0 = time.monotonic()
        while time.monotonic() < deadline - 30:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            if server.poll() is not None:
                raise RuntimeError(f"vLLM exited {server.returncode}: {last_error(work / 'serving_vllm.log')}")
            time.sleep(2)
        else:
            raise RuntimeError("vLLM did not answer /health in time")
        result["server_start_s"] = round(time.monotonic() - t0, 1)
        t1 = time.monotonic()
        cmd = [sys.executable, "launch.py", "prepare", "--target", str(model), "--prompts", str(prompts),
               "--out", str(work / "ds"), "--server", f"http://127.0.0.1:{port}", "--max-new-tokens", "32",
               "--concurrency", "16"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(10.0, deadline - time.monotonic()))
        (work / "serving_prepare.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode:
            raise RuntimeError(f"prepare --server exit {proc.returncode}: {last_error(work / 'serving_prepare.log')}")
        meta = json.loads((work / "ds" / "prepare.json").read_text())
        engine = meta.get("engine", {})
        result.update(path=engine.get("path"), rows=meta["completions"], generated_tokens=meta["generated_tokens"],
                      tokens_per_s=_sig(meta["generated_tokens"] / (time.monotonic() - t1)),
                      token_exact=engine.get("path") == "token_ids")
    except Exception as e:  # noqa: BLE001 - recorded in the section's line
        result["error"] = first_line(e)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    emit(result, out)
    return result


def bench_env(out: str | None = None) -> dict:
    import importlib.util

    result = {"section": "env", "python": sys.version.split()[0]}
    for mod in ("torch", "transformers", "pyarrow", "psutil", "yaml", "safetensors", "pynvml", "tensorboard"):
        result[mod] = importlib.util.find_spec(mod) is not None
    try:
        import torch
        import transformers

        n = torch.cuda.device_count()
        result.update(torch=torch.__version__, transformers=transformers.__version__,
                      cuda=torch.cuda.is_available(), devices=[torch.cuda.get_device_name(i) for i in range(n)],
                      device_memory_gib=[_gib(torch.cuda.get_device_properties(i).total_memory) for i in range(n)])
    except Exception as e:  # noqa: BLE001 - recorded; the sections that need torch fail on their own
        result["error"] = first_line(e)
    for name, path in (("shm_free_gb", "/dev/shm"), ("tmp_free_gb", "/tmp")):
        with contextlib.suppress(OSError):
            result[name] = round(shutil.disk_usage(path).free / 2 ** 30, 1)
    emit(result, out)
    return result


PYTEST_OUTCOMES = ("passed", "failed", "errors", "error", "skipped", "xfailed", "xpassed", "deselected")


def pytest_counts(log: Path) -> dict:
    """``{"passed": 3, "skipped": 1, ..., "tests": {name: outcome}, "finished": bool}`` from
    a ``pytest -v`` log: the counts of its summary line, or, where it was killed before
    printing one, of its per-test lines, and then the test it was in (``killed_in``)."""
    if not log.is_file():
        return {}
    lines = log.read_text(errors="replace").splitlines()
    tests, running = {}, None
    for line in lines:
        m = re.match(r"^(\S+::\S+)(?: (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b)?", line)
        if m:
            name = m.group(1).rsplit("::", 1)[1]
            if m.group(2):
                tests[name] = m.group(2)
                running = None
            else:
                running = name
    out: dict = {}
    for line in reversed(lines):
        if line.startswith("=") and " in " in line:
            found = re.findall(r"(\d+) (" + "|".join(PYTEST_OUTCOMES) + r")\b", line)
            if found:
                out = {("errors" if k == "error" else k): int(n) for n, k in found}
                break
    finished = bool(out)
    if not finished:
        for outcome in tests.values():
            key = {"ERROR": "errors", "XFAIL": "xfailed", "XPASS": "xpassed"}.get(outcome, outcome.lower())
            out[key] = out.get(key, 0) + 1
        if running:
            out["killed_in"] = running
    return {**out, "tests": tests, "finished": finished}


HEADLINE = ("passed", "failed", "errors", "killed_in", "match", "rel_diff", "target_save_s", "plan_s", "block_tokens",
            "micro_batches", "steps", "tokens_per_s", "tflops", "mfu", "skipped")
"""A section's keys shown in its line of the final printout, where it has them."""


def pruned(data):
    """``data`` without the None values of its dicts, at any depth: the final line is
    read from an output tail of 12,000 characters."""
    if isinstance(data, dict):
        return {k: pruned(v) for k, v in data.items() if v is not None}
    return data


def collect(work: Path, started: float | None = None) -> dict:
    """The final line from ``sections.tsv`` (name, exit code or ``skipped``, seconds) and
    each section's JSON (pruned, and without the plan ``prepare`` shows already);
    ``failed`` names every section that did not finish cleanly; ``plan_vs_measured``
    gathers the sections' rows (their nulls kept: a row has every column)."""
    result: dict = {"check": "gpu_check"}
    if started:
        result["wall_s"] = round(time.time() - started, 1)
    sections, failed, skipped, rows, prepared = {}, [], [], [], None
    tsv = work / "sections.tsv"
    for row in (tsv.read_text().splitlines() if tsv.is_file() else []):
        name, rc, secs = (row.split("\t") + ["", ""])[:3]
        sections[name] = {"rc": rc, "s": int(secs) if secs.isdigit() else None}
    result["sections"] = sections
    for name, st in sections.items():
        if st["rc"] == "skipped":
            skipped.append(name)
            continue
        data = pytest_counts(work / "cuda_tests.log") if name == "cuda_tests" else read_json(work / f"{name}.json")
        data.pop("section", None)
        rows += [{"section": name, **r} for r in data.pop("plan_vs_measured", None) or []]
        if name == "cuda_tests" and "tests" in data:    # the tests that did not pass, by name
            data["tests"] = {k: v for k, v in data["tests"].items() if v != "PASSED"}
        if name == "prepare":
            prepared = data.get("plan")
        elif data.get("plan") and data["plan"] == prepared:
            del data["plan"]
        if data:
            result[name] = pruned(data)
        err = data.get("error") or (f"killed in {data['killed_in']}" if data.get("killed_in") else None)
        if st["rc"] != "0" or err:
            why = {"124": f"timed out after {st['s']} s", "137": f"killed after {st['s']} s"}.get(st["rc"], "")
            line = err or last_error(work / f"{name}.log") or f"exit {st['rc']}"
            failed.append({"section": name, "rc": st["rc"], "error": f"{why}: {line}" if why else line})
    result["plan_vs_measured"] = rows
    result["skipped"] = skipped
    result["failed"] = failed
    return result


def report_lines(result: dict) -> list[str]:
    """One short line per section and one per planned process, for the output's tail."""
    out = []
    for name, st in result.get("sections", {}).items():
        data = result.get(name) or {}
        shown = ", ".join(f"{k} {data[k]}" for k in HEADLINE if data.get(k) not in (None, ""))
        out.append(f"{name}: {st['rc']} in {st['s']} s" + (f"; {shown}" if shown else ""))
    for r in result.get("plan_vs_measured", []):
        out.append(f"plan {r['section']} {r['process']} {r['device']}: {r['planned_gib']} GiB planned "
                   f"({r['context_gib']} context); peak {r['measured_peak_gib']} allocated, "
                   f"{r['reserved_peak_gib']} reserved")
    return [x[:200] for x in out]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("env", "prepare", "tiny", "nodes", "target", "drafter", "pipeline", "serving",
                                     "collect"))
    ap.add_argument("dir", nargs="?", help="collect: the folder of the section files ($WORK)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: exercise the code, measure nothing")
    ap.add_argument("--out", help="also write the JSON line to this file")
    ap.add_argument("--limit", type=float, default=float(os.environ.get("SECTION_S", 300)) - 10,
                    help="seconds for the launches (default: $SECTION_S - 10)")
    ap.add_argument("--work", default=os.environ.get("WORK", "/tmp/gpu_check_work"),
                    help="where launch logs and plans go")
    ap.add_argument("--started", type=float, help="collect: the check's start (unix time)")
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.what == "collect":
        result = collect(Path(args.dir or work), args.started)
        for line in report_lines(result):
            print(line)
        emit(result, args.out)
        return 0
    if args.what == "env":
        bench_env(args.out)
        return 0
    if args.what == "prepare":
        return 1 if "error" in prepare(work, args.smoke, args.out) else 0
    if args.what in ("target", "drafter"):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        if args.what == "target":
            device, sizes = setup(args.smoke)
            r = bench_target(sizes, device, args.out)
        else:
            plan = prepare(work, args.smoke)   # before this process touches the GPU
            device, sizes = setup(args.smoke)
            r = bench_drafter(sizes, device, plan, args.out)
    elif args.what == "pipeline":
        r = bench_pipeline(Path("/tmp/gpu-pipe"), work, args.limit, args.smoke, args.out)
    elif args.what == "tiny":
        r = bench_tiny(work, args.limit, args.smoke, args.out)
    elif args.what == "serving":
        r = bench_serving(work, args.limit, args.out)
    else:
        r = bench_nodes(work, args.limit, args.smoke, args.out)
    return 1 if r.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
