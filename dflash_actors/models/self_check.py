"""The target's self-check: its packed-batch features against the model's own forward.

Run by every target actor before its first batch (``target.self_check``, on by default);
a tensor-parallel gang's split model is also checked against its checkpoint
(``tensor_parallel.check_split``), with the same error and tolerances.
"""

from __future__ import annotations

import torch

from ..data.batching import Batch


class SelfCheckError(ValueError):
    """The target wrapper's features are not the model's hidden states."""


# Largest error allowed, relative to the layer's largest activation: float32 differs only
# by summation order; half precision kernels differ by a few ulps of 8 mantissa bits.
SELF_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@torch.no_grad()
def self_check(target, length: int = 16, seed: int = 0) -> None:
    """Raise ``SelfCheckError`` unless ``target.features`` of a packed two-sequence batch
    equals, per sequence and per layer, the model's own forward with
    ``output_hidden_states`` at ``hidden_states[L + 1]`` (layer id L's output). (A
    tensor-parallel target is also checked against its checkpoint:
    ``tensor_parallel.check_split``.)

    This is what a wrong layer mapping, a leak between packed sequences, position ids
    that do not restart, or a model-specific forward the wrapper bypasses would break;
    training would run on such features without complaint.

    The packed sequences are a random text and, before it, its own first half: under a
    causal mask the half's features are the first rows of the whole text's, so one
    plain forward is the reference for both. The check costs two forwards (the
    wrapper's and the plain one), which a CPU restart of a large target pays in full.
    """
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, target.vocab_size, (length,), generator=g)
    lens = [length // 2, length]
    batch = Batch(torch.cat([text[:lens[0]], text]), torch.cat([torch.arange(n) for n in lens]),
                  torch.ones(sum(lens), dtype=torch.int8),
                  torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32), max(lens))
    got = target.features(batch).float().split(lens)
    _, want = target.logits_and_hidden(text[None].to(target.device), target.feature_ids)
    _compare(got, want[0].float().to(got[0].device), target, "the model's own forward",
             SELF_CHECK_TOLERANCE.get(target.dtype, 3e-2))


def _compare(got: tuple[torch.Tensor, ...], want: torch.Tensor, target, what: str, tol: float) -> None:
    width = target.hidden_size
    for s, feats in enumerate(got):
        for i, layer in enumerate(target.feature_ids):
            a, b = feats[:, i * width:(i + 1) * width], want[:len(feats), i * width:(i + 1) * width]
            err, scale = float((a - b).abs().max()), float(b.abs().max())
            if not err <= tol * max(scale, 1.0):
                raise SelfCheckError(
                    f"target.self_check: layer {layer} features differ from {what} "
                    f"(hidden_states[{layer + 1}]) on packed sequence {s}: max error {err:.3g}, "
                    f"activations up to {scale:.3g}, tolerance {tol:g} relative ({target.dtype})")
