"""Section 2a: the target forward of a Qwen3-8B-shaped bf16 target built on the device.
"""

from __future__ import annotations

import statistics
import time

from .common import SMOKE, Sizes, building_on, device_name, emit, error_line, memory_gib, reset_memory, sig, sync, timed
from .flops import peak_tflops, rates, target_flops


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
              "build_s": sig(time.perf_counter() - t, 3)}
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, sizes.model["vocab_size"], (sizes.rows, sizes.seq_len), device=device, generator=g)
    last = []

    def forward(_i):
        last[:] = [target.hidden(ids)]

    try:
        times = timed(forward, sizes.warmup, sizes.runs, device)
        flops = target_flops(sizes.model, target.layer_ids, sizes.rows, sizes.seq_len)
        result.update(times_s=[sig(x) for x in times], flops_per_batch=sig(flops),
                      **rates(flops, statistics.median(times), tokens, peak_tflops(device)),
                      features_finite=bool(torch.isfinite(last[0]).all()))
    except Exception as e:  # noqa: BLE001 - an OOM is a result to record
        result["error"] = error_line(e)
    result["max_allocated_gib"] = memory_gib(device)["max_allocated_gib"]
    emit(result, out)
    return result
