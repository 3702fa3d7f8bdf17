"""Greedy speculative decoding, as serving runs it: draft a block, verify it, keep what matches.

``speculative_generate`` follows z-lab's ``dflash_generate`` at temperature 0: from the
verified prefix a proposer drafts ``block_size - 1`` tokens after the anchor, one
cached target forward verifies them, the longest matching prefix plus the target's own
next token is kept, and the target's KV cache is cropped back to what was verified.
Its output must equal the target's own greedy text (``greedy_generate``, cache-free,
or ``greedy_cached``): decoding is lossless or it is wrong.

Many prompts at once (``speculative_generate_rows``, ``greedy_rows``): each step is one
target forward for all of them (``extend_rows``: the matrix products batched, attention
per prompt against its own cache), so the weights are read once per step, not once per
prompt. On CPU each prompt's decoding is then the one ``speculative_generate`` makes
alone, bit for bit: a matrix product rounds a row as it does in any other batch once the
row's own matrix has ``EXACT_ROWS`` rows or more, as a verify block (``block_size``
tokens) and the drafter's head (``block_size - 1``) have; smaller blocks run one prompt at
a time. Greedy's single token per forward is batched anyway, so ``greedy_rows`` can differ
from ``greedy_cached`` in the last bit of a logit, as a verify block's logits already do.

``replay`` is decoding's walk without the target, for a proposer whose drafts are known
against the target's greedy text: as that text is what lossless decoding verifies, the
accepted lengths follow from it.

Proposers: the trained drafter (``drafter_proposer``, ``DrafterBlocks`` for many prompts,
with its context keys and values cached), and the baselines a drafter must beat: the
training completions' most frequent next token (``NgramProposer``) and the anchor
repeated (``repeat_proposer``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..models.dspark import markov_walk
from ..models.xpress import jacobi, xpress_sizes

EXACT_ROWS = 4
"""Rows from which MKL's float32 matrix product on CPU rounds each row the same whatever
the other rows: measured here (AVX-512, 1 and 2 threads), 1 to 3 rows take other kernels.
``test_rows_forward_equals_each_row_alone`` fails where this does not hold."""


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
    cache, ids = target.new_cache(), prompt.to(target.device)
    logits, _ = target.extend(ids, 0, cache)
    calls = 1
    while len(ids) < len(prompt) + max_new_tokens:
        ids = torch.cat([ids, logits[-1].argmax()[None]])
        if stop_ids and int(ids[-1]) in stop_ids or len(ids) == len(prompt) + max_new_tokens:
            break
        logits, _ = target.extend(ids[-1:], len(ids) - 1, cache)
        calls += 1
    return ids, calls


@torch.no_grad()
def greedy_rows(target, prompts: list[torch.Tensor], max_new_tokens: int) -> list[torch.Tensor]:
    """``greedy_cached`` of every prompt for exactly ``max_new_tokens``, stop tokens
    included (cut with ``cut_at_stop``), one target forward per step for all prompts."""
    caches = [target.new_cache() for _ in prompts]
    ids = []
    for p, cache in zip(prompts, caches):
        p = p.to(target.device)
        logits, _ = target.extend(p, 0, cache)
        ids.append(torch.cat([p, logits[-1].argmax()[None]]))
    for _ in range(max_new_tokens - 1):
        logits, _ = extend_rows(target, torch.stack([x[-1:] for x in ids]), [len(x) - 1 for x in ids], caches)
        ids = [torch.cat([x, row[-1].argmax()[None]]) for x, row in zip(ids, logits)]
    return ids


_ROWS = "dflash_rows"


def _rows_attention(module, query, key, value, attention_mask, *, dflash_rows, **kwargs):
    """``extend_rows``'s attention: row r against its own cache, through the same sdpa
    call (and mask) ``TargetModel.extend`` makes for it alone."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out = []
    for r, (cache, mask) in enumerate(dflash_rows):
        k, v = cache.update(key[r:r + 1], value[r:r + 1], module.layer_idx)
        out.append(sdpa_attention_forward(module, query[r:r + 1], k, v, mask, **kwargs)[0])
    return torch.cat(out), None


def _causal_mask(past: int, n: int, device) -> torch.Tensor | None:
    """The mask transformers builds for ``n`` queries after ``past`` cached positions:
    none where sdpa's own causal flag (or no mask) is exact, else boolean ``[1, 1, n, past + n]``."""
    if past == 0 or n == 1:
        return None
    keys = torch.arange(past + n, device=device)
    return (keys[None, :] <= torch.arange(past, past + n, device=device)[:, None])[None, None]


def _rows_batchable(config) -> bool:
    """Whether every layer attends like the one mask ``_causal_mask`` builds (full causal
    sdpa) and caches the keys and values it attends with: MLA (DeepSeek-V3's
    ``kv_lora_rank``) caches its compressed latents, which ``_rows_attention`` cannot update."""
    types = getattr(config, "layer_types", None) or ["full_attention"]
    return (config._attn_implementation == "sdpa" and all(t == "full_attention" for t in types)
            and getattr(config, "kv_lora_rank", None) is None)


@torch.no_grad()
def extend_rows(target, tokens: torch.Tensor, starts: list[int], caches: list) -> tuple[torch.Tensor, torch.Tensor]:
    """``TargetModel.extend`` of several generations in one forward: row r of ``tokens``
    ``[N, n]`` at positions ``starts[r]..`` after the ``starts[r]`` positions in
    ``caches[r]`` (extended in place). Returns logits ``[N, n, V]`` and selected layers
    ``[N, n, k*H]``. A target whose attention is not plain causal sdpa runs row by row."""
    model = target.model
    config = model.config
    if not _rows_batchable(config):
        out = [target.extend(t, s, c) for t, s, c in zip(tokens, starts, caches)]
        return torch.stack([o[0] for o in out]), torch.stack([o[1] for o in out])
    from transformers import AttentionInterface

    if _ROWS not in AttentionInterface._global_mapping:
        AttentionInterface.register(_ROWS, _rows_attention)
    n, dev = tokens.shape[1], tokens.device
    positions = torch.stack([torch.arange(s, s + n, device=dev) for s in starts])
    rows = [(cache, _causal_mask(s, n, dev)) for cache, s in zip(caches, starts)]
    # The model has no cache of its own here (each row brings one), so transformers
    # builds no mask and the attention above gets each row's.
    config._attn_implementation = _ROWS
    try:
        out = model(input_ids=tokens, position_ids=positions, use_cache=False, output_hidden_states=True,
                    dflash_rows=rows)
    finally:
        config._attn_implementation = "sdpa"
    return out.logits, torch.cat([out.hidden_states[L + 1] for L in target.layer_ids], dim=-1)


def verify_block(drafter) -> int:
    """The tokens a verify step checks, the anchor and the drafts (the ``block_size`` of
    ``speculative_generate``): a DFlash's block, a DSpark's block + 1 (its anchor slot
    drafts too, so its ``block_size`` slots make ``block_size`` drafts; vLLM's default
    ``num_speculative_tokens`` for DSpark is the drafter's ``block_size``)."""
    return drafter.block_size + getattr(drafter, "label_shift", 0)


class DrafterBlocks:
    """The drafter's greedy blocks (a DFlash2's: its selector's walk; a DSpark's: its Markov
    walk, each slot's logits biased by the token drafted before it; an XPress's: its
    ``num_jacobi_passes`` Jacobi rounds, ``models.xpress.jacobi``) for several
    generations (``propose_rows`` of ``speculative_generate_rows``; ``drafter_proposer``
    is one generation).

    For row r, ``ids[-1]`` is the anchor (verified, no target state yet) and ``feats`` the
    target features of every position before it, so the drafter sees exactly what
    training's ``< a`` mask shows it. Each row's context keys and values are cached: a call
    computes them only for the positions verified since the row's previous call (hence one
    instance per set of generations). The vocabulary head, most of a block's cost, runs
    once for all rows (per row for blocks under ``EXACT_ROWS`` drafts).
    """

    def __init__(self, drafter, target, rows: int):
        self.drafter, self.target = drafter, target
        self.kv: list[list] = [[] for _ in range(rows)]
        self.seen = [0] * rows

    @torch.no_grad()
    def __call__(self, rows: list[int], ids: list[torch.Tensor], feats: list[torch.Tensor]) -> list[torch.Tensor]:
        whole = [self._hidden(r, i, f) for r, i, f in zip(rows, ids, feats)]
        first = 1 - getattr(self.drafter, "label_shift", 0)
        hidden = [h[first:].to(self.target.dtype) for h in whole]
        drafts = verify_block(self.drafter) - 1
        if drafts < EXACT_ROWS:
            logits = [self.target.lm_head(h) for h in hidden]
        else:
            logits = list(self.target.lm_head(torch.cat(hidden)).split(drafts))
        refiner = getattr(self.drafter, "refiner_head", None)
        if refiner is not None:
            # XPress: the backbone's argmax, then its Jacobi rounds over the whole block
            # (slot 0's state enters the block mean and the mixer); slot 0 reads the anchor
            # as its previous token, as vLLM 0.33 serves it (``models.xpress``).
            passes = xpress_sizes(self.drafter.config)["num_jacobi_passes"]
            return [jacobi(refiner, b[None], x[None], i[-1:], i[-1:], passes)[0] for b, x, i in zip(whole, logits, ids)]
        markov = getattr(self.drafter, "markov_head", None)
        if markov is not None:
            return [markov_walk(markov, x[None], i[-1:])[0] for x, i in zip(logits, ids)]
        selector = self.drafter.candidate_selector
        if selector is None:
            return [x.argmax(-1) for x in logits]
        # A DFlash2 proposes its selector's walk from the anchor through each slot's top-K.
        return [selector.walk(h[None], x[None], i[-1:])[0] for h, x, i in zip(hidden, logits, ids)]

    def _hidden(self, r: int, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        d = self.drafter
        if len(feats) < self.seen[r]:
            raise ValueError("drafter_proposer: one proposer per generation (the context went backwards)")
        if len(feats) > self.seen[r]:
            ctx = d.context(feats[self.seen[r]:].to(d.fc.weight.dtype))[None]
            new = d.context_kv(ctx, torch.arange(self.seen[r], len(feats), device=ids.device)[None])
            kv = self.kv[r]
            self.kv[r] = new if not kv else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                             for (k0, v0), (k1, v1) in zip(kv, new)]
            self.seen[r] = len(feats)
        B, start = d.block_size, len(ids) - 1
        block = torch.full((B,), d.mask_token_id, dtype=torch.long, device=ids.device)
        block[0] = ids[-1]
        noise = self.target.embed_tokens(block)[None].to(d.fc.weight.dtype)
        positions = torch.arange(start, start + B, device=ids.device)[None]
        return d.forward_cached(noise, self.kv[r], positions)[0]     # the whole block, slot 0 included


def drafter_proposer(drafter, target):
    """``propose(ids, feats)`` for one ``speculative_generate`` call: the drafter's greedy
    block (``DrafterBlocks`` of one generation)."""
    blocks = DrafterBlocks(drafter, target, 1)
    return lambda ids, feats: blocks([0], [ids], [feats])[0]


@dataclass
class Generation:
    """One speculative generation, counted as z-lab's repository loop of April 2026 counts
    it, which is also what vLLM's acceptance counters give (``serve-check``). z-lab's 0.1.0
    release verifies a shorter last block near ``max_new_tokens`` and counts only the
    tokens that fit; the tokens are the same (``tests/unit/test_parity_zlab.py`` pins both
    relations), only the last step's count differs."""

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


class _Decoding:
    """One generation between verify steps: what ``speculative_generate`` and
    ``speculative_generate_rows`` share, so that both decode alike."""

    def __init__(self, target, prompt: torch.Tensor, max_new_tokens: int, block_size: int,
                 stop_ids: tuple[int, ...]):
        self.P, self.end, self.stop_ids = len(prompt), len(prompt) + max_new_tokens, stop_ids
        self.cache, ids = target.new_cache(), prompt.to(target.device)
        logits, self.feats = target.extend(ids, 0, self.cache)
        # A verify step extends by a block; a linear-attention or sliding layer must be able
        # to take back what the target rejects (``keep_rollback``).
        target.keep_rollback(self.cache, block_size)
        self.ids = torch.cat([ids, logits[-1].argmax()[None]])
        self.start = self.P    # ids[start] is verified but has no target state yet: the anchor
        self.gen = Generation(self.ids, [], [], [])
        self.stops = torch.tensor(stop_ids, dtype=torch.long, device=ids.device)

    @property
    def done(self) -> bool:
        return self.start >= self.end or bool(len(self.stops) and torch.isin(self.ids[self.P:], self.stops).any())

    def block(self, draft: torch.Tensor) -> torch.Tensor:
        """What the target verifies: the anchor, then the drafts."""
        return torch.cat([self.ids[self.start:self.start + 1], draft])

    def accept(self, draft: torch.Tensor, logits: torch.Tensor, new_feats: torch.Tensor) -> None:
        """Keep the drafts the target agrees with (``logits`` of ``block(draft)``) and its own next token."""
        posterior = logits.argmax(-1)                 # the target's tokens for start+1 ..
        accepted = int((draft == posterior[:-1]).long().cumprod(0).sum())
        self.ids = torch.cat([self.ids[:self.start + 1], draft[:accepted], posterior[accepted:accepted + 1]])
        self.feats = torch.cat([self.feats, new_feats[:accepted + 1]])
        self.gen.starts.append(self.start)
        self.gen.accepted.append(accepted)
        self.gen.lengths.append(accepted + 1)
        self.start += accepted + 1
        # A negative crop removes that many tokens in every transformers version; crop(0)
        # too, as it also drops what a recording layer kept of this step (``keep_rollback``).
        self.cache.crop(-(self.cache.get_seq_length() - self.start))

    def result(self) -> Generation:
        self.gen.ids = cut_at_stop(self.ids[:self.end], self.P, self.stop_ids)
        return self.gen


@torch.no_grad()
def speculative_generate(propose, target, prompt: torch.Tensor, max_new_tokens: int, block_size: int,
                         stop_ids: tuple[int, ...] = ()) -> Generation:
    """Greedy draft-then-verify with a KV cache on the target.

    The prefill yields the first token; each step drafts ``block_size - 1`` tokens after
    the anchor (``propose(ids, feats)``), verifies ``[anchor, drafts]`` in one cached
    target forward, keeps the longest prefix the target agrees with plus the target's
    next token, and crops the cache back to the verified positions. Stops once
    ``max_new_tokens`` are produced or a stop token was.
    """
    d = _Decoding(target, prompt, max_new_tokens, block_size, stop_ids)
    while not d.done:
        draft = propose(d.ids, d.feats)[:block_size - 1]
        d.accept(draft, *target.extend(d.block(draft), d.start, d.cache))
    return d.result()


@torch.no_grad()
def speculative_generate_rows(propose_rows, target, prompts: list[torch.Tensor], max_new_tokens: int,
                              block_size: int, stop_ids: tuple[int, ...] = ()) -> list[Generation]:
    """``speculative_generate`` of every prompt, each verify step one target forward for
    all unfinished prompts (``extend_rows``; blocks under ``EXACT_ROWS`` one at a time).
    ``propose_rows(rows, ids, feats)`` drafts for the listed rows (``DrafterBlocks``)."""
    gens = [_Decoding(target, p, max_new_tokens, block_size, stop_ids) for p in prompts]
    while live := [i for i, d in enumerate(gens) if not d.done]:
        drafts = [x[:block_size - 1] for x in propose_rows(live, [gens[i].ids for i in live],
                                                           [gens[i].feats for i in live])]
        blocks = [gens[i].block(x) for i, x in zip(live, drafts)]
        if block_size >= EXACT_ROWS:
            logits, feats = extend_rows(target, torch.stack(blocks), [gens[i].start for i in live],
                                        [gens[i].cache for i in live])
        else:
            logits, feats = zip(*(target.extend(b, gens[i].start, gens[i].cache) for i, b in zip(live, blocks)))
        for i, draft, lg, ft in zip(live, drafts, logits, feats):
            gens[i].accept(draft, lg, ft)
    return [d.result() for d in gens]


def replay(correct: np.ndarray, text: torch.Tensor, prompt_len: int, max_new_tokens: int,
           stop_ids: tuple[int, ...] = ()) -> Generation:
    """The ``Generation`` of speculative decoding from ``text[:prompt_len]`` when ``text``
    is the target's greedy continuation and ``correct[a - prompt_len]`` ``[B-1]`` says which
    drafts of the block at anchor a equal it (``tau.drafter_correct``, ``proposer_correct``):
    each step accepts the leading correct drafts. A verify step sees up to ``B - 1`` tokens
    past ``max_new_tokens`` (and past a stop token), so ``text`` must reach that far."""
    P, end, width = prompt_len, prompt_len + max_new_tokens, correct.shape[1]
    if len(text) < end + width:
        raise ValueError(f"replay: the text has {len(text) - P} tokens after the prompt, decoding verifies "
                         f"up to {max_new_tokens + width}")
    lead = np.cumprod(correct, axis=1).sum(1)
    stop = len(cut_at_stop(text, P, stop_ids)) - 1   # decoding ends once this position is verified
    gen = Generation(cut_at_stop(text[:end], P, stop_ids), [], [], [])
    start = P
    while start < min(end, stop):
        accepted = int(lead[start - P])
        gen.starts.append(start)
        gen.accepted.append(accepted)
        gen.lengths.append(accepted + 1)
        start += accepted + 1
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
