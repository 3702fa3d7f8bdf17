"""Greedy speculative decoding, as serving runs it: draft a block, verify it, keep what matches.

``speculative_generate`` follows z-lab's ``dflash_generate`` at temperature 0: from the
verified prefix a proposer drafts ``block_size - 1`` tokens after the anchor, one
cached target forward verifies them, the longest matching prefix plus the target's own
next token is kept, and the target's KV cache is cropped back to what was verified.
Its output must equal the target's own greedy text (``greedy_generate``, cache-free,
or ``greedy_cached``): decoding is lossless or it is wrong.

Proposers: the trained drafter (``drafter_proposer``, with its context keys and values
cached), and the baselines a drafter must beat: the training completions' most
frequent next token (``NgramProposer``) and the anchor repeated (``repeat_proposer``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@torch.no_grad()
def greedy_generate(target, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The target's own greedy continuation ``[P + max_new_tokens]``, every step a full
    forward of the whole prefix: the slow, cache-free reference for losslessness."""
    ids = prompt.to(target.device)
    for _ in range(max_new_tokens):
        logits, _ = target.logits_and_hidden(ids[None])
        ids = torch.cat([ids, logits[0, -1].argmax()[None]])
    return ids


def cut_at_stop(ids: torch.Tensor, prompt_len: int, stop_ids: tuple[int, ...]) -> torch.Tensor:
    """``ids`` up to and including the first stop token after the prompt."""
    if stop_ids:
        hit = torch.isin(ids[prompt_len:], torch.tensor(stop_ids, device=ids.device)).nonzero()
        if len(hit):
            return ids[:prompt_len + int(hit[0]) + 1]
    return ids


@torch.no_grad()
def greedy_cached(target, prompt: torch.Tensor, max_new_tokens: int,
                  stop_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, int]:
    """Plain greedy decoding with a KV cache, as serving runs it without a drafter:
    ``(ids, target calls)``; one call per generated token."""
    from transformers import DynamicCache

    cache, ids = DynamicCache(), prompt.to(target.device)
    logits, _ = target.extend(ids, 0, cache)
    calls = 1
    while len(ids) < len(prompt) + max_new_tokens:
        ids = torch.cat([ids, logits[-1].argmax()[None]])
        if stop_ids and int(ids[-1]) in stop_ids or len(ids) == len(prompt) + max_new_tokens:
            break
        logits, _ = target.extend(ids[-1:], len(ids) - 1, cache)
        calls += 1
    return ids, calls


def drafter_proposer(drafter, target):
    """``propose(ids, feats)`` for one ``speculative_generate`` call: the drafter's greedy block.

    ``ids[-1]`` is the anchor (verified, no target state yet) and ``feats`` the target
    features of every position before it, so the drafter sees exactly what training's
    ``< a`` mask shows it. The context's keys and values are cached: each call computes
    them only for the positions verified since the previous call (hence one proposer
    per generation).
    """
    B = drafter.block_size
    dtype = drafter.fc.weight.dtype
    kv: list = []
    seen = 0

    def propose(ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        nonlocal kv, seen
        if len(feats) < seen:
            raise ValueError("drafter_proposer: one proposer per generation (the context went backwards)")
        if len(feats) > seen:
            ctx = drafter.context(feats[seen:].to(dtype))[None]
            new = drafter.context_kv(ctx, torch.arange(seen, len(feats), device=ids.device)[None])
            kv = new if not kv else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                     for (k0, v0), (k1, v1) in zip(kv, new)]
            seen = len(feats)
        start = len(ids) - 1
        block = torch.full((B,), drafter.mask_token_id, dtype=torch.long, device=ids.device)
        block[0] = ids[-1]
        noise = target.embed_tokens(block)[None].to(dtype)
        positions = torch.arange(start, start + B, device=ids.device)[None]
        hidden = drafter.forward_cached(noise, kv, positions)[0, 1:]
        return target.lm_head(hidden.to(target.dtype)).argmax(-1)
    return propose


@dataclass
class Generation:
    """One speculative generation, counted as z-lab's benchmark counts it."""

    ids: torch.Tensor
    """Prompt and output, cut at ``P + max_new_tokens`` and after the first stop token."""
    lengths: list[int]
    """Tokens produced per verify step: accepted drafts + the target's own token, the last
    step counted in full even where it overshoots ``max_new_tokens``."""
    starts: list[int]
    """The anchor position of each verify step."""
    accepted: list[int]
    """Accepted drafts per verify step (``lengths - 1``)."""

    @property
    def target_calls(self) -> int:
        return 1 + len(self.lengths)       # the prefill, then one verify per step


@torch.no_grad()
def speculative_generate(propose, target, prompt: torch.Tensor, max_new_tokens: int, block_size: int,
                         stop_ids: tuple[int, ...] = ()) -> Generation:
    """Greedy draft-then-verify with a KV cache on the target.

    The prefill yields the first token; each step drafts ``block_size - 1`` tokens after
    the anchor, verifies ``[anchor, drafts]`` in one cached target forward, keeps the
    longest prefix the target agrees with plus the target's next token, and crops the
    cache back to the verified positions. Stops once ``max_new_tokens`` are produced or
    a stop token was.
    """
    from transformers import DynamicCache

    P = len(prompt)
    end = P + max_new_tokens
    cache, ids = DynamicCache(), prompt.to(target.device)
    logits, feats = target.extend(ids, 0, cache)
    ids = torch.cat([ids, logits[-1].argmax()[None]])
    start = P            # ids[start] is verified but has no target state yet: the anchor
    gen = Generation(ids, [], [], [])
    stops = torch.tensor(stop_ids, dtype=torch.long, device=ids.device)
    while start < end and not (len(stops) and torch.isin(ids[P:], stops).any()):
        draft = propose(ids[:start + 1], feats)[:block_size - 1]
        logits, new_feats = target.extend(torch.cat([ids[start:start + 1], draft]), start, cache)
        posterior = logits.argmax(-1)                 # the target's tokens for start+1 ..
        accepted = int((draft == posterior[:-1]).long().cumprod(0).sum())
        ids = torch.cat([ids[:start + 1], draft[:accepted], posterior[accepted:accepted + 1]])
        feats = torch.cat([feats, new_feats[:accepted + 1]])
        gen.starts.append(start)
        gen.accepted.append(accepted)
        gen.lengths.append(accepted + 1)
        start += accepted + 1
        drop = cache.get_seq_length() - start
        if drop:        # a negative crop removes that many tokens in every transformers version
            cache.crop(-drop)
    gen.ids = cut_at_stop(ids[:end], P, stop_ids)
    return gen


def conditional_acceptance(accepted: list[int], slots: int) -> list[float | None]:
    """Per draft slot k (1-based): P(slot k accepted | slots < k were), from accepted
    drafts per step; None where no step reached the slot."""
    a = np.asarray(accepted)
    out = []
    for k in range(1, slots + 1):
        reached = int((a >= k - 1).sum())
        out.append(round(float((a >= k).sum() / reached), 4) if reached else None)
    return out


class NgramProposer:
    """The trivial baseline: continue with the training completions' most frequent next
    token after the last two tokens (else after the last one, else repeat it)."""

    def __init__(self, dataset, block_size: int):
        from collections import Counter, defaultdict

        self.block_size = block_size
        tri, bi = defaultdict(Counter), defaultdict(Counter)
        for i in range(len(dataset)):
            ids, mask = dataset.sample(i)
            first = int(np.argmax(mask)) if mask.any() else len(ids)
            seq = ids[max(first - 2, 0):].tolist()
            for a, b, c in zip(seq, seq[1:], seq[2:]):
                tri[(a, b)][c] += 1
            for b, c in zip(seq, seq[1:]):
                bi[b][c] += 1
        self.tri = {k: v.most_common(1)[0][0] for k, v in tri.items()}
        self.bi = {k: v.most_common(1)[0][0] for k, v in bi.items()}

    def __call__(self, ids: torch.Tensor, feats=None) -> torch.Tensor:
        seq = ids[-2:].tolist()
        for _ in range(self.block_size - 1):
            nxt = self.tri.get((seq[-2], seq[-1])) if len(seq) >= 2 else None
            seq.append(nxt if nxt is not None else self.bi.get(seq[-1], seq[-1]))
        return torch.tensor(seq[-(self.block_size - 1):], device=ids.device)


def repeat_proposer(block_size: int):
    """The other trivial baseline: every draft slot repeats the anchor."""
    def propose(ids: torch.Tensor, feats=None) -> torch.Tensor:
        return ids[-1:].repeat(block_size - 1)
    return propose
