"""The in-process generation engine of ``prepare``: the target loaded here, generating
shard after shard with transformers' ``generate``.

An engine turns a shard of templated prompts into responses: ``shard(encoded, members,
s)`` returns ``(prompt indices, token arrays, loss masks)`` in prompt order, and
``report()`` what ``prepare.json`` records of how it generated. The serving engine
(``serving.py``) has the same two methods.
"""

from __future__ import annotations

import dataclasses
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
    top_k: int = 50
    """Sampling keeps the k most likely tokens (0: all). 50 is transformers' default, which
    ``generate`` applied to every sampled dataset made before this setting existed."""
    batching: str = "continuous"
    """``fixed``: a shard's prompts in groups of the batch size, each group generated
    until its longest response ends (rows that stopped early ride along idle).
    ``continuous``: a row that stops takes the next waiting prompt, and once none waits
    finished rows leave the batch (``ContinuousBatch``). Sampled text differs between
    the two (another random stream), so it is part of what a dataset records."""


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
    kwargs = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k} if sample else {}
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), do_sample=sample,
                             max_new_tokens=sampling.max_new_tokens, eos_token_id=stops or None,
                             pad_token_id=pad_id, **kwargs)
    responses = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        responses.append(row[:cut])
    return responses


BATCHINGS = ("fixed", "continuous")


def batching_for(model, batching: str) -> str:
    """``batching``, unless ``continuous`` and the model keeps a layer state other than
    keys and values (Qwen3-Next's and Qwen3.5's linear attention: a convolution window
    and a recurrent state), which ``ContinuousBatch``'s re-packed per-layer cache cannot
    carry: then ``fixed`` (transformers' own ``generate``, whose left padding such layers
    mask out). Greedy text is the same either way."""
    kinds = set(getattr(model.config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    return "fixed" if batching == "continuous" and kinds else batching

REFILL_SHARE = 0.25
"""A continuous batch takes new prompts once this share of its rows is free (or it is
empty): each admission is one prefill forward, so admitting one prompt at a time would
pay many small ones."""


def sampling_probs(logits: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    """The distribution each row of ``logits`` [B, V] is sampled from: the temperature,
    then the k most likely tokens, then the smallest set whose probability reaches top_p
    (transformers' order and rules), renormalised by the draw."""
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if sampling.top_p < 1:
        p, order = probs.sort(-1)      # ascending, as transformers cuts: the first token always stays
        drop = p.cumsum(-1) <= 1 - sampling.top_p
        drop[:, -1] = False
        probs = probs.scatter(-1, order, p.masked_fill(drop, 0.0))
    return probs


def sample_next(logits: torch.Tensor, sampling: SamplingSettings, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``logits`` [B, V]: the argmax when greedy, else one draw from
    ``sampling_probs`` with ``generator``."""
    if sampling.temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits, sampling), 1, generator=generator)[:, 0]


class ContinuousBatch:
    """A decode of many prompts in one KV cache of at most ``width`` rows: a row whose
    response ends (a stop token, or ``max_new_tokens``) takes the next waiting prompt,
    and once none is waiting finished rows leave, so no row computes for nothing.

    Rows are left-padded to the cache's length; each row's positions count its own
    tokens only, and the attention mask hides the padding, so a row sees exactly its
    prompt and its response. Leading columns that are padding in every row are cut
    after each admission and departure. One ``generator`` draws every sampled token in
    a fixed order (the schedule depends only on the prompts and the tokens drawn), so
    the same prompts and seed give the same responses.
    """

    def __init__(self, model, width: int, stops: list[int], pad: int, sampling: SamplingSettings,
                 generator: torch.Generator, on_done=None):
        self.model, self.width, self.stops, self.pad = model, width, set(stops), pad
        self.sampling, self.generator, self.on_done = sampling, generator, on_done
        self.device = model.get_input_embeddings().weight.device
        self.keys: list[torch.Tensor] = []      # per layer [B, heads, T, head_dim]
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)     # [B, T]
        self.pos = torch.zeros(0, dtype=torch.long, device=self.device)         # [B] next position
        self.last = torch.zeros(0, dtype=torch.long, device=self.device)        # [B] token to feed next
        self.rows: list[int | None] = []        # prompt index per row; None once finished
        self.out: dict[int, list[int]] = {}
        self.row_steps = self.idle_row_steps = 0

    def run(self, prompts: list[tuple[int, list[int]]]) -> dict[int, list[int]]:
        """Responses by prompt index, each cut after its first stop token."""
        waiting = list(reversed(prompts))
        while waiting or self.live():
            free = [k for k, r in enumerate(self.rows) if r is None]
            room = self.width - len(self.rows) + len(free)
            if waiting and (self.live() == 0 or room >= max(1, int(REFILL_SHARE * self.width))):
                self._admit([waiting.pop() for _ in range(min(room, len(waiting)))], free)
            if not waiting and self.live() < len(self.rows):
                self._keep([k for k, r in enumerate(self.rows) if r is not None])
            if self.live():
                self._step()
        return self.out

    def live(self) -> int:
        return sum(r is not None for r in self.rows)

    @torch.no_grad()
    def _forward(self, ids, mask, pos, cache):
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=cache) if cache else DynamicCache()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                            use_cache=True).logits[:, -1]
        return logits, [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]

    def _admit(self, new: list[tuple[int, list[int]]], free: list[int]) -> None:
        """Prefill ``new`` together, then put them in the free rows (and new ones)."""
        w = max(len(p) for _, p in new)
        ids = torch.full((len(new), w), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (_, p) in enumerate(new):
            ids[r, w - len(p):] = torch.tensor(p)
            mask[r, w - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(1) - 1).clamp_(min=0)
        logits, keys, values = self._forward(ids, mask, pos, None)
        t = max(w, self.mask.shape[1])
        slots = free[:len(new)] + list(range(len(self.rows), len(self.rows) + len(new) - len(free[:len(new)])))
        grow = len(self.rows) + len(new) - len(free[:len(new)])

        def merged(old: torch.Tensor | None, fresh: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(fresh.shape)
            shape[0], shape[dim] = grow, t
            out = fresh.new_zeros(shape)
            if old is not None and old.shape[0]:
                out.narrow(dim, t - old.shape[dim], old.shape[dim])[:old.shape[0]] = old
            out[slots] = 0         # a finished row's cache and mask, now another prompt's
            out.narrow(dim, t - w, w)[slots] = fresh
            return out
        self.keys = [merged(o, f, 2) for o, f in zip(self.keys or [None] * len(keys), keys)]
        self.values = [merged(o, f, 2) for o, f in zip(self.values or [None] * len(values), values)]
        self.mask = merged(self.mask, mask, 1)
        self.pos = torch.cat([self.pos, self.pos.new_zeros(grow - len(self.pos))])
        self.pos[slots] = mask.sum(1)
        self.last = torch.cat([self.last, self.last.new_zeros(grow - len(self.last))])
        self.rows += [None] * (grow - len(self.rows))
        for k, (i, _) in zip(slots, new):
            self.rows[k] = i
            self.out[i] = []
        tokens = self.last.clone()
        tokens[slots] = sample_next(logits, self.sampling, self.generator)
        self._take(tokens, slots)
        self._trim()

    def _step(self) -> None:
        mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], 1)
        logits, self.keys, self.values = self._forward(self.last[:, None], mask, self.pos[:, None],
                                                       list(zip(self.keys, self.values)))
        self.mask = mask
        self.pos += 1
        live = [k for k, r in enumerate(self.rows) if r is not None]
        self.row_steps += len(self.rows)
        self.idle_row_steps += len(self.rows) - len(live)
        self._take(sample_next(logits, self.sampling, self.generator), live)

    def _take(self, tokens: torch.Tensor, slots: list[int]) -> None:
        """Row k's next token is tokens[k] for the rows in ``slots``; a row that ends is freed."""
        self.last = tokens.to(self.last.dtype)
        got = self.last.tolist()
        for k in slots:
            i = self.rows[k]
            out = self.out[i]
            out.append(got[k])
            if got[k] in self.stops or len(out) >= self.sampling.max_new_tokens:
                self.rows[k] = None
                if self.on_done is not None:
                    self.on_done(len(out))

    def _keep(self, rows: list[int]) -> None:
        """Only ``rows`` stay in the batch (no prompt is waiting for the others)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.keys = [k.index_select(0, idx) for k in self.keys]
        self.values = [v.index_select(0, idx) for v in self.values]
        self.mask, self.pos, self.last = self.mask[idx], self.pos[idx], self.last[idx]
        self.rows = [self.rows[k] for k in rows]
        self._trim()

    def _trim(self) -> None:
        """Cut the leading columns that are padding in every row."""
        used = self.mask.any(0).nonzero()
        cut = int(used[0]) if len(used) else self.mask.shape[1]
        if cut:
            self.keys = [k[:, :, cut:] for k in self.keys]
            self.values = [v[:, :, cut:] for v in self.values]
            self.mask = self.mask[:, cut:]


class InProcessEngine:
    """The target, loaded once, generating shard after shard."""

    def __init__(self, target_dir: Path, tokenizer, sampling: SamplingSettings, batch_size: int, device: str, bar):
        from transformers import AutoModelForCausalLM

        if sampling.batching not in BATCHINGS:
            raise ValueError(f"batching must be one of {', '.join(BATCHINGS)} (got {sampling.batching!r})")
        self.device = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = resolve_dtype(sampling.dtype, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(self.device).eval()
        # What the dataset records (prepare.json): the batching that really ran.
        sampling = dataclasses.replace(sampling, batching=batching_for(self.model, sampling.batching))
        self.stops = stop_ids(tokenizer, self.model)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.stops or [0])[0]
        self.sampling, self.batch_size, self.bar = sampling, batch_size, bar
        self.t0, self.new_tokens = time.perf_counter(), 0
        self.row_steps = self.idle_row_steps = 0
        """Decode steps summed over the rows in the batch, and those of rows already done."""

    def shard(self, encoded: list[list[int]], members: range, s: int) -> tuple[list[int], list, list]:
        """``(prompt indices, token arrays, loss masks)`` of shard ``s``, in prompt order."""
        # Similar lengths together waste less padding; the order is fixed, so a rerun
        # of this shard batches (and samples) exactly as the first try did.
        idx = sorted(members, key=lambda i: (len(encoded[i]), i))
        seed = self.sampling.seed * 1_000_003 + s * 1009
        if self.sampling.batching == "continuous":
            gen = torch.Generator(device=self.device).manual_seed(seed)
            batch = ContinuousBatch(self.model, self.batch_size, self.stops, self.pad, self.sampling, gen,
                                    on_done=self._done)
            responses = batch.run([(i, encoded[i]) for i in idx])
            self.row_steps += batch.row_steps
            self.idle_row_steps += batch.idle_row_steps
        else:
            responses = {}
            for k in range(0, len(idx), self.batch_size):
                group = idx[k:k + self.batch_size]
                got = generate_batch(self.model, [encoded[i] for i in group], self.sampling, self.stops, self.pad,
                                     seed + k)
                steps = max(len(r) for r in got)
                self.row_steps += steps * len(group)
                self.idle_row_steps += sum(steps - len(r) for r in got)
                for i, r in zip(group, got):
                    responses[i] = r
                    self._done(len(r))
        order = sorted(responses)
        seqs = [np.asarray(encoded[i] + responses[i], np.int32) for i in order]
        masks = [np.r_[np.zeros(len(encoded[i]), np.int8), np.ones(len(responses[i]), np.int8)] for i in order]
        return order, seqs, masks

    def _done(self, tokens: int) -> None:
        self.new_tokens += tokens
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(tok_s=f"{self.new_tokens / (time.perf_counter() - self.t0):.0f}")

    def report(self) -> dict:
        """What ``prepare.json`` keeps of this engine's work."""
        return {"engine": "in-process", "batching": self.sampling.batching, "row_steps": self.row_steps,
                "idle_row_steps": self.idle_row_steps,
                "tokens_per_s": round(self.new_tokens / max(time.perf_counter() - self.t0, 1e-9), 1)}
