"""What ``benchmarks/gpu_check.sh`` measures on a lent GPU, one subcommand per section.

    python -m benchmarks.gpu_bench env                       # versions, device, /dev/shm, disk
    python -m benchmarks.gpu_bench target [--save DIR]       # 2a: target forward, Qwen3-8B shape, bf16
    python -m benchmarks.gpu_bench drafter                   # 2b: drafter train step per compute dtype
    python -m benchmarks.gpu_bench pipeline --variant V --target-dir DIR   # 2c: launch.py 1-1 on cuda:0
    python -m benchmarks.gpu_bench tiny                      # 3: tiny 2-2 vs the reference, monitor view
    python -m benchmarks.gpu_bench nodes                     # 3: two nodes over loopback
    python -m benchmarks.gpu_bench collect OUT               # the final {"check": "gpu_check", ...} line

Each measuring subcommand prints one JSON line and, with ``--out FILE``, writes it there
too, rewritten as each part finishes: a section that runs out of time still leaves the
parts it finished. ``--smoke`` runs the same code on CPU with tiny shapes (hidden 64,
6 layers, vocab 256, 2 x 64 tokens), so that the paths are exercised where no GPU is;
its numbers mean nothing.

Choices, and why:
  * 2a and 2b build Qwen3-8B-shaped modules directly on the device with random weights
    (nothing to download; seconds, not minutes): speed does not depend on the values.
  * 2b builds only the target's ``embed_tokens`` and ``lm_head`` (bf16, frozen, the
    modules ``TargetModel`` hands the loss) instead of the whole target: 16 GB less on
    the device that holds the drafter's activations.
  * FLOPs come from ``costmodel`` (the counts the run summaries use for MFU): matmuls
    ``2 * weights * tokens``, causal attention over half a row on average, drafter
    forward+backward as 3x forward. The target counts only layers ``0..max(layer_ids)``:
    ``TargetModel.hidden`` stops the forward after the deepest selected layer. Recomputed
    work (the checkpointed cross-entropy chunks) is not counted, as usual for MFU.
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
SPECFORGE_MFU = 0.44
"""SpecForge's reported DFlash trainer MFU on an H200: the public anchor for 2b."""

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                max_position_embeddings=40960, tie_word_embeddings=False)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rope_theta=1e6, max_position_embeddings=4096,
            tie_word_embeddings=False)


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
    slow_runs: tuple[int, int]
    """(warmup, runs) for a float32 drafter step: several seconds each on an H200."""


FULL = Sizes(QWEN3_8B, rows=8, seq_len=2048, draft_layers=5, block_size=16, num_anchors=512, warmup=2, runs=5,
             slow_runs=(1, 3))
SMOKE = Sizes(TINY, rows=2, seq_len=64, draft_layers=2, block_size=4, num_anchors=8, warmup=1, runs=2,
              slow_runs=(1, 2))


def say(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def _sig(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


def emit(result: dict, out: str | None) -> None:
    """Write ``result`` to ``out`` (whole, by rename) and print it as one line."""
    line = json.dumps(result)
    if out:
        tmp = Path(out).with_suffix(".tmp")
        tmp.write_text(line + "\n")
        os.replace(tmp, out)
    print(line, flush=True)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


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
# timing


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


def peak_memory_gb(device) -> float | None:
    import torch

    return _sig(torch.cuda.max_memory_allocated(device) / 2 ** 30) if device.type == "cuda" else None


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


def bench_target(sizes: Sizes, device, save: str | None = None, out: str | None = None) -> dict:
    """2a; then, with ``save``, the model saved for 2c even when the measurement failed."""
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
                      features_finite=bool(torch.isfinite(last[0]).all()), peak_mem_gb=peak_memory_gb(device))
    except Exception as e:  # noqa: BLE001 - recorded; 2c still needs the saved model
        result.update(error=first_line(e), peak_mem_gb=peak_memory_gb(device))
    last.clear()
    emit(result, out)
    if save:
        t = time.perf_counter()
        save_model(target.model, Path(save))
        result["saved"] = {"path": save, "s": _sig(time.perf_counter() - t, 3)}
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


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ---------------------------------------------------------------------------
# 2b: the drafter train step


COMPUTE_DTYPES = ("auto", "float32")
"""``train.compute_dtype`` values measured in 2b: bf16 autocast (the CUDA default), fp32."""


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


def train_step(drafter, head, features, batch, num_anchors: int, compute_dtype: str, stats: dict):
    """``step(i)``: the drafter actor's work on batch i (``batch_loss``, then ``backward``
    into fresh gradients); the last loss and block count go into ``stats``."""
    from dflash_actors.models.loss import Objective, batch_loss

    params = list(drafter.parameters())

    def step(i: int) -> None:
        for p in params:
            p.grad = None
        loss, st = batch_loss(drafter, head, features, batch, Objective(num_anchors, 7.0, 0, compute_dtype),
                              epoch=0, batch_id=i)
        loss.backward()
        stats.update(loss=float(loss.detach()), blocks=st.blocks)
    return step


def bench_drafter(sizes: Sizes, device, out: str | None = None) -> dict:
    drafter, head, features, batch, layer_ids = build_drafter_step(sizes, device)
    params = list(drafter.parameters())
    tokens = sizes.rows * sizes.seq_len
    result = {"section": "drafter", "device": device_name(device),
              "shape": "smoke" if sizes is SMOKE else "qwen3-8b", "draft_layers": sizes.draft_layers,
              "block_size": sizes.block_size, "num_anchors": sizes.num_anchors, "layer_ids": layer_ids,
              "batch": [sizes.rows, sizes.seq_len], "tokens": tokens, "params": sum(p.numel() for p in params),
              "specforge_mfu": SPECFORGE_MFU, "variants": {}}
    peak = peak_tflops(device)
    for cd in COMPUTE_DTYPES:
        name = cd
        stats: dict = {}
        step = train_step(drafter, head, features, batch, sizes.num_anchors, cd, stats)
        reset_memory(device)
        warmup, runs = (sizes.warmup, sizes.runs) if cd == "auto" else sizes.slow_runs
        try:
            times = timed(step, warmup, runs, device)
        except Exception as e:  # noqa: BLE001 - an OOM or a compile failure is a result to record
            result["variants"][name] = {"error": first_line(e), "peak_mem_gb": peak_memory_gb(device)}
            say(f"drafter {name}: {first_line(e)}")
            for p in params:
                p.grad = None
            emit(result, out)
            continue
        anchors = max(1, round(stats["blocks"] / sizes.rows))
        flops = drafter_flops(sizes.model, len(layer_ids), sizes.draft_layers, sizes.rows, sizes.seq_len,
                              anchors, sizes.block_size)
        row = {"compute_dtype": cd, "times_s": [_sig(x) for x in times], "anchors_per_row": anchors,
               "flops_per_batch": _sig(flops), **rates(flops, statistics.median(times), tokens, peak),
               "loss": _sig(stats["loss"]), "peak_mem_gb": peak_memory_gb(device)}
        row["mfu_over_specforge"] = _sig(row["mfu"] / SPECFORGE_MFU, 3)
        result["variants"][name] = row
        emit(result, out)
    if not result["variants"]:
        emit(result, out)
    return result


# ---------------------------------------------------------------------------
# 2c: the real pipeline, 1-1 on one GPU


PIPELINE_VARIANTS = {
    # name: (runtime.schedule, runtime.feature_transport)
    "pipelined_cuda": ("pipelined", "cuda"),
    "lockstep_cuda": ("lockstep", "cuda"),
    "pipelined_host": ("pipelined", "host"),
}


def pipeline_sets(target_dir: str | None, device: str, samples: int, smoke: bool) -> list[str]:
    """``--set`` overrides of 2c: the 8B-shaped target, a 5-layer drafter, 8 x ~2048-token
    batches of synthetic data (``samples`` / 8 optimizer steps), no evaluation, a hang
    timeout past the first batch's flex_attention compilation."""
    sets = [f"topology.target_devices=[{device}]", f"topology.drafter_devices=[{device}]",
            "train.epochs=1", "train.checkpoint_every=0", "eval.every=0", "runtime.hang_timeout_s=300",
            "monitor.console=lines", "monitor.tensorboard=false", "data.synthetic.heldout_samples=0",
            f"data.synthetic.num_samples={samples}"]
    if target_dir is not None:
        sets.append(f"target.path={target_dir}")
    if smoke:
        return sets + ["data.cache_dir=/tmp/gpu-bench-smoke-cache"]
    return sets + ["drafter.num_layers=5", "drafter.block_size=16",
                   "batching.token_budget=16384", "data.max_seq_len=2048", "train.num_anchors=512",
                   "data.synthetic.prompt_len=[64, 128]", "data.synthetic.completion_len=[1920, 1984]",
                   "data.cache_dir=/tmp/gpu-cache"]


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


def bench_pipeline(variant: str, target_dir: str | None, run_dir: Path, log: Path, limit_s: float,
                   samples: int, smoke: bool, out: str | None = None) -> dict:
    schedule, transport = PIPELINE_VARIANTS[variant]
    if smoke:
        transport = "host"      # cuda needs both ends on a GPU
    result = {"section": "pipeline", "variant": variant, "schedule": schedule, "feature_transport": transport}
    if not (Path(target_dir) / "config.json").is_file():
        if not smoke:
            result["error"] = f"no saved target at {target_dir} (section target did not save it)"
            emit(result, out)
            return result
        target_dir = None       # the smoke run falls back to the tiny default target
    sets = pipeline_sets(target_dir, "cpu" if smoke else "cuda:0", samples, smoke)
    sets.append(f"runtime.schedule={schedule}")
    if variant != next(iter(PIPELINE_VARIANTS)):
        # The first variant runs the target's start-up self-check (bf16, random weights,
        # never tried on a GPU); should it refuse, the other two still measure.
        sets.append("target.self_check=false")
    sets.append(f"runtime.feature_transport={transport}")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "launch.py", "--topology", "1-1", "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    t = time.perf_counter()
    rc, timed_out = run_launch(cmd, log, limit_s, grace_s=min(40.0, limit_s / 4))
    result.update(rc=rc, timed_out=timed_out, wall_s=round(time.perf_counter() - t, 1))
    summary = {}
    with contextlib.suppress(OSError, ValueError):
        summary = json.loads((run_dir / "summary.json").read_text())
    rate = steady(read_jsonl(run_dir / "metrics.jsonl", "step"))
    result.update(result_reason=summary.get("result"), steps=summary.get("step"),
                  total_steps=summary.get("total_steps"), loss=summary.get("loss"),
                  summary_tokens_per_s=summary.get("tokens_per_s"), summary_wall_s=summary.get("wall_s"),
                  restarts=summary.get("restarts"), steady=rate, tokens_per_s=rate.get("tokens_per_s"),
                  stages=stage_view(summary, rate))
    if rc != 0:
        result["error"] = (f"timed out after {limit_s:.0f} s; " if timed_out else f"exit {rc}; ") + \
            (last_error(log) or "no output")
    # Each checkpoint of this drafter is ~12 GB (weights and AdamW moments): three runs
    # of them would fill the lent machine's disk.
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    emit(result, out)
    return result


# ---------------------------------------------------------------------------
# 3: tiny models on CUDA: 2-2 against the reference, the monitor's view, two nodes


def tiny_sets(smoke: bool) -> list[str]:
    return ["data.cache_dir=/tmp/gpu-bench-smoke-cache" if smoke else "data.cache_dir=/tmp/gpu-cache",
            "train.epochs=1", "monitor.console=lines", "monitor.tensorboard=false"]


def devices_sets(device: str, n: int) -> list[str]:
    devs = ", ".join([device] * n)
    return [f"topology.target_devices=[{devs}]", f"topology.drafter_devices=[{devs}]"]


def with_sets(cmd: list[str], sets: list[str]) -> list[str]:
    for s in sets:
        cmd = cmd + ["--set", s]
    return cmd


def bench_tiny(logs: Path, limit_s: float, smoke: bool, out: str | None = None) -> dict:
    """The tiny default target 2-2 (all on one device) and the single-process reference,
    side by side; equal within tolerance on CUDA (not bits); the monitor's GPU view."""
    device = "cpu" if smoke else "cuda:0"
    run, ref = Path("/tmp/gpu-2-2"), Path("/tmp/gpu-ref")
    for d in (run, ref):
        shutil.rmtree(d, ignore_errors=True)
    sets = tiny_sets(smoke)
    cmds = {"pipeline_2_2": with_sets([sys.executable, "launch.py", "--topology", "2-2", "--run-dir", str(run)],
                                      sets + devices_sets(device, 2)),
            "reference_2_2": with_sets([sys.executable, "launch.py", "reference", "--topology", "2-2",
                                        "--run-dir", str(ref)], sets)}
    procs = {k: subprocess.Popen(c, cwd=ROOT, stdout=open(logs / f"{k}.log", "w"), stderr=subprocess.STDOUT)
             for k, c in cmds.items()}
    deadline = time.monotonic() + limit_s
    result = {"section": "tiny"}
    for k, p in procs.items():
        try:
            result[f"{k}_rc"] = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            result[f"{k}_rc"] = p.wait()
            result.setdefault("error", f"{k} timed out after {limit_s:.0f} s")
    summary, reference = {}, {}
    with contextlib.suppress(OSError, ValueError):
        summary = json.loads((run / "summary.json").read_text())
    with contextlib.suppress(OSError, ValueError):
        reference = json.loads((ref / "reference.json").read_text())
    losses = []
    with contextlib.suppress(OSError, ValueError):
        losses = json.loads((run / "losses.json").read_text())
    a, b = (losses[-1] if losses else None), reference.get("final_loss")
    rel = abs(a - b) / max(abs(b), 1e-12) if a is not None and b is not None else None
    result.update(steps=summary.get("step"), final_loss=a, reference_final_loss=b, rel_diff=_sig(rel),
                  match=rel is not None and rel < 2e-2, tokens_per_s=summary.get("tokens_per_s"),
                  reference_tokens_per_s=reference.get("tokens_per_s"))
    resources = read_jsonl(run / "metrics.jsonl", "resources")
    result["gpu_mem_mb"] = {a: v["gpu_mem_mb"] for r in resources for a, v in r["actors"].items()
                            if v.get("gpu_mem_mb")}
    result["gpus"] = resources[-1].get("gpus") if resources else None
    result["stages"] = {k: v for k, v in (summary.get("stages") or {}).items() if k in ("target", "drafter")}
    for k in procs:
        if result[f"{k}_rc"] != 0:
            result.setdefault("error", f"{k} exit {result[f'{k}_rc']}: {last_error(logs / f'{k}.log')}")
    emit(result, out)
    return result


def bench_nodes(logs: Path, limit_s: float, smoke: bool, out: str | None = None) -> dict:
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
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=open(logs / f"nodes_{r}.log", "w"),
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
        for line in (logs / f"nodes_{r}.log").read_text(errors="replace").splitlines():
            if '"cluster"' in line:
                with contextlib.suppress(ValueError):
                    clusters.append(json.loads(line)["cluster"])
    result["cluster"] = clusters
    for r, rc in enumerate(result["rc"]):
        if rc != 0:
            result.setdefault("error", f"node {r} exit {rc}: {last_error(logs / f'nodes_{r}.log')}")
    emit(result, out)
    return result


# ---------------------------------------------------------------------------
# the environment, and the final line


def bench_serving(logs: Path, limit_s: float, out: str | None = None) -> dict:
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
                              stdout=open(logs / "serving_vllm.log", "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        t0 = time.monotonic()
        while time.monotonic() < deadline - 30:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            if server.poll() is not None:
                raise RuntimeError(f"vLLM exited {server.returncode}: {last_error(logs / 'serving_vllm.log')}")
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
        (logs / "serving_prepare.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode:
            raise RuntimeError(f"prepare --server exit {proc.returncode}: {last_error(logs / 'serving_prepare.log')}")
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

        result.update(torch=torch.__version__, transformers=transformers.__version__,
                      cuda=torch.cuda.is_available(), devices=[torch.cuda.get_device_name(i)
                                                               for i in range(torch.cuda.device_count())])
    except Exception as e:  # noqa: BLE001 - recorded; the sections that need torch fail on their own
        result["error"] = first_line(e)
    for name, path in (("shm_free_gb", "/dev/shm"), ("tmp_free_gb", "/tmp")):
        with contextlib.suppress(OSError):
            result[name] = round(shutil.disk_usage(path).free / 2 ** 30, 1)
    emit(result, out)
    return result


def pytest_counts(log: Path) -> dict:
    """``{"passed": 3, "skipped": 1, ...}`` from pytest's last summary line."""
    if not log.is_file():
        return {}
    for line in reversed(log.read_text(errors="replace").splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", line)
        if found:
            return {k: int(n) for n, k in found}
    return {}


def ratio(a, b) -> float | None:
    return _sig(a / b, 3) if a and b else None


def collect(out_dir: Path, started: float | None = None) -> dict:
    """The final line from ``sections.tsv`` (name, exit code or ``skipped``, seconds) and
    each section's JSON; ``failed`` names every section that did not finish cleanly."""
    result: dict = {"check": "gpu_check"}
    if started:
        result["wall_s"] = round(time.time() - started, 1)
    sections, failed, skipped = {}, [], []
    rows = (out_dir / "sections.tsv").read_text().splitlines() if (out_dir / "sections.tsv").is_file() else []
    for row in rows:
        name, rc, secs = (row.split("\t") + ["", ""])[:3]
        sections[name] = {"rc": rc, "s": int(secs) if secs.isdigit() else None}
    result["sections"] = sections
    pipeline = {}
    for name, st in sections.items():
        data = {}
        with contextlib.suppress(OSError, ValueError):
            data = json.loads((out_dir / f"{name}.json").read_text())
        if st["rc"] == "skipped":
            skipped.append(name)
            continue
        if name == "cuda_tests":
            data = pytest_counts(out_dir / "cuda_tests.log")
        if name.startswith("pipe_"):
            pipeline[name[5:]] = data
        elif data:
            result[name] = data
        err = data.get("error")
        if name == "drafter":
            errs = [f"{k}: {v['error']}" for k, v in data.get("variants", {}).items() if "error" in v]
            err = err or ("; ".join(errs) if errs else None)
        if st["rc"] != "0" or err:
            why = {"124": f"timed out after {st['s']} s", "137": f"killed after {st['s']} s"}.get(st["rc"], "")
            line = err or last_error(out_dir / f"{name}.log") or f"exit {st['rc']}"
            failed.append({"section": name, "rc": st["rc"], "error": f"{why}: {line}" if why else line})
    if pipeline:
        rate = {k: v.get("tokens_per_s") for k, v in pipeline.items()}
        pipeline["pipelined_over_lockstep"] = ratio(rate.get("pipelined_cuda"), rate.get("lockstep_cuda"))
        pipeline["cuda_over_host"] = ratio(rate.get("pipelined_cuda"), rate.get("pipelined_host"))
        result["pipeline"] = pipeline
    result["skipped"] = skipped
    result["failed"] = failed
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("env", "target", "drafter", "pipeline", "tiny", "nodes", "serving", "collect"))
    ap.add_argument("dir", nargs="?", help="collect: the folder of the section files ($OUT)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: exercise the code, measure nothing")
    ap.add_argument("--out", help="also write the JSON line to this file")
    ap.add_argument("--save", help="target: then save the model here (safetensors), for the pipeline")
    ap.add_argument("--variant", choices=tuple(PIPELINE_VARIANTS), default="pipelined_cuda")
    ap.add_argument("--target-dir", default="/tmp/gpu-q8")
    ap.add_argument("--samples", type=int, default=80, help="pipeline: synthetic samples (8 per optimizer step)")
    ap.add_argument("--limit", type=float, default=float(os.environ.get("SECTION_S", 300)) - 10,
                    help="seconds for the launches (default: $SECTION_S - 10)")
    ap.add_argument("--logs", default=os.environ.get("OUT", "/tmp/gpu_check"), help="where launch logs go")
    ap.add_argument("--started", type=float, help="collect: the check's start (unix time)")
    args = ap.parse_args(argv)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    if args.what == "collect":
        emit(collect(Path(args.dir or logs), args.started), args.out)
        return 0
    if args.what == "env":
        bench_env(args.out)
        return 0
    if args.what in ("target", "drafter"):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        device, sizes = setup(args.smoke)
        if args.what == "target":
            bench_target(sizes, device, args.save, args.out)
        else:
            bench_drafter(sizes, device, args.out)
        return 0
    if args.what == "pipeline":
        r = bench_pipeline(args.variant, args.target_dir, Path(f"/tmp/gpu-pipe-{args.variant}"),
                           logs / f"pipe_{args.variant}_launch.log", args.limit, args.samples, args.smoke, args.out)
    elif args.what == "tiny":
        r = bench_tiny(logs, args.limit, args.smoke, args.out)
    elif args.what == "serving":
        r = bench_serving(logs, args.limit, args.out)
    else:
        r = bench_nodes(logs, args.limit, args.smoke, args.out)
    return 1 if r.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
