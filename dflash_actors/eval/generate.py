"""The in-process generation engine of ``prepare``: the target loaded here, generating
shard after shard with transformers' ``generate``.

An engine turns a shard of templated prompts into responses: ``shard(encoded, members,
s)`` returns ``(prompt indices, token arrays, loss masks)`` in prompt order, and
``report()`` what ``prepare.json`` records of how it generated. The serving engine
(``serving.py``) has the same two methods.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..models.target import resolve_dtype


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    dtype: str = "auto"
    """The target's dtype while generating: auto = bfloat16 on CUDA, float32 on CPU. A CPU
    with bf16 instructions (AVX512-BF16, AMX) generates faster in bfloat16 (SmolLM2 on
    this project's 2-core VM: 177 tokens/s against 102); the text is then that of the
    target as a GPU serves it, not of its fp32 weights."""


def stop_ids(tokenizer, model) -> list[int]:
    """End-of-turn ids: the tokenizer's eos and the generation config's."""
    ids = set()
    for v in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return sorted(ids)


def generate_batch(model, prompts: list[list[int]], sampling: SamplingSettings, stops: list[int],
                   pad_id: int, seed: int) -> list[list[int]]:
    """Responses to ``prompts`` (left-padded together), each cut after its first stop token."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        attn[r, width - len(p):] = 1
    device = model.get_input_embeddings().weight.device
    torch.manual_seed(seed)
    sample = sampling.temperature > 0
    kwargs = {"temperature": sampling.temperature, "top_p": sampling.top_p} if sample else {}
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), do_sample=sample,
                             max_new_tokens=sampling.max_new_tokens, eos_token_id=stops or None,
                             pad_token_id=pad_id, **kwargs)
    responses = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        responses.append(row[:cut])
    return responses


class InProcessEngine:
    """The target, loaded once, generating shard after shard."""

    def __init__(self, target_dir: Path, tokenizer, sampling: SamplingSettings, batch_size: int, device: str, bar):
        from transformers import AutoModelForCausalLM

        dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = resolve_dtype(sampling.dtype, dev)
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(dev).eval()
        self.stops = stop_ids(tokenizer, self.model)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.stops or [0])[0]
        self.sampling, self.batch_size, self.bar = sampling, batch_size, bar
        self.t0, self.new_tokens = time.perf_counter(), 0

    def shard(self, encoded: list[list[int]], members: range, s: int) -> tuple[list[int], list, list]:
        """``(prompt indices, token arrays, loss masks)`` of shard ``s``, in prompt order."""
        # Similar lengths together waste less padding; the order is fixed, so a rerun
        # of this shard batches (and samples) exactly as the first try did.
        idx = sorted(members, key=lambda i: (len(encoded[i]), i))
        responses: dict[int, list[int]] = {}
        for k in range(0, len(idx), self.batch_size):
            group = idx[k:k + self.batch_size]
            seed = self.sampling.seed * 1_000_003 + s * 1009 + k
            for i, r in zip(group, generate_batch(self.model, [encoded[i] for i in group], self.sampling,
                                                  self.stops, self.pad, seed)):
                responses[i] = r
                self.new_tokens += len(r)
            self.bar.update(len(group))
            self.bar.set_postfix(tok_s=f"{self.new_tokens / (time.perf_counter() - self.t0):.0f}")
        order = sorted(responses)
        seqs = [np.asarray(encoded[i] + responses[i], np.int32) for i in order]
        masks = [np.r_[np.zeros(len(encoded[i]), np.int8), np.ones(len(responses[i]), np.int8)] for i in order]
        return order, seqs, masks
