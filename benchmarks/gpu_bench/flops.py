"""FLOPs and MFU of the target forward and the drafter step, from ``train.costmodel``'s counts.
"""

from __future__ import annotations

from .common import sig


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
    return {"step_s": sig(seconds), "tokens_per_s": sig(tokens / seconds), "tflops": sig(tflops),
            "peak_tflops": peak, "mfu": sig(tflops / peak)}
