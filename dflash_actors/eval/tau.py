"""Acceptance length tau, simulated from the training objective and real from decoding.

* Simulated tau puts an anchor at *every* candidate position (``m[a] = m[a+1] = 1``)
  of a text, so it does not depend on the anchor sampler: 1 + leading correct draft
  slots, averaged over blocks (``simulated_tau`` over a dataset in batches,
  ``drafter_correct`` + ``text_metrics`` over one text).
* Real tau is what ``decode.speculative_generate`` achieves: tokens per verify step,
  counted as z-lab's benchmark counts them (``real_tau``, ``decode_stats``). As lossless
  decoding verifies exactly the target's greedy text, it can also be replayed from a
  proposer's drafts against that text, computed once (``TargetTexts``, ``replayed_tau``),
  at the proposer's cost alone.
* The two agree only on the target's own text, since decoding visits the target's
  greedy continuation: ``evaluate_drafter`` measures both on held-out prompts
  continued by the target (``prepare.regenerate``), and ``walk_tau`` replays real
  decoding's walk on simulated acceptances.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..data.batching import Batch, BatchBuffers, assemble, plan_for
from ..data.dataset import open_dataset
from ..data.synthetic import ensure_synthetic_dataset
from ..models.blocks import all_anchors, anchor_candidates, block_hidden, block_labels
from ..models.drafter_start import build_drafter
from ..models.loss import decay_gamma, dflash_loss
from ..models.target import ensure_target, load_target
from ..models.xpress import jacobi, xpress_sizes
from ..prepare.regenerate import prompts_of, regenerate
from .decode import (
    EXACT_ROWS,
    DrafterBlocks,
    Generation,
    conditional_acceptance,
    cut_at_stop,
    greedy_cached,
    greedy_generate,
    greedy_rows,
    replay,
    speculative_generate_rows,
    verify_block,
)
from .intervals import mean_interval


@torch.no_grad()
def simulated_tau(drafter, target, dataset, cfg) -> dict:
    """Objective metrics over the whole dataset with anchors at every candidate position."""
    buf = BatchBuffers.allocate(cfg.batching.token_budget, cfg.batching.max_samples)
    plan = plan_for(cfg, dataset.lengths, 0)
    total = None
    for b in range(len(plan)):
        batch = Batch.from_buffers(buf, assemble(dataset, plan.batch(b), buf)).to(target.device)
        _, stats = dflash_loss(drafter, target, target.features(batch), batch, all_anchors(batch), decay_gamma(cfg))
        total = stats if total is None else total + stats
    return total.metrics()


@torch.no_grad()
def walk_tau(drafter, target, dataset) -> float:
    """Real decoding's walk replayed on simulated acceptances: from the first completion
    token, jump by each anchor's ``1 + leading correct``. On target text this equals
    real tau (up to float noise); the gap to ``simulated_tau`` is then only weighting:
    simulated tau averages over every position, decoding visits fewer positions where
    acceptance is long, so uneven acceptance makes simulated tau the larger."""
    tokens, steps = walk_counts(drafter, target, dataset)
    return sum(tokens) / max(sum(steps), 1)


@torch.no_grad()
def walk_counts(drafter, target, dataset, keep: list | None = None,
                limit: int | None = None) -> tuple[list[int], list[int]]:
    """``walk_tau``'s tokens and verify steps per text (for intervals over texts), over
    the first ``limit`` texts (all by default). ``keep``, if given, receives each text's
    ``drafter_correct`` pair, so simulated metrics (``text_metrics``) come from the same pass."""
    tokens, steps = [], []
    for i in range(min(len(dataset), limit if limit is not None else len(dataset))):
        ids, mask = dataset.sample(i)
        correct, valid = drafter_correct(drafter, target, torch.from_numpy(ids), mask)
        if keep is not None:
            keep.append((correct, valid))
        t, s = text_walk(correct, mask)
        tokens.append(t)
        steps.append(s)
    return tokens, steps


def proposer_walk_counts(propose, dataset, block_size: int) -> tuple[list[int], list[int]]:
    """``walk_counts`` for a proposer that needs no target features (the n-gram table):
    the same walk over the same texts, so the two compare text by text."""
    tokens, steps = [], []
    for i in range(len(dataset)):
        ids, mask = dataset.sample(i)
        ids_t, anchors, first = torch.from_numpy(ids), anchor_candidates(mask), int(np.argmax(mask))
        correct, _ = proposer_correct(propose, ids_t, first, block_size)    # a row per position from the first
        _, valid = block_labels(ids_t, torch.from_numpy(mask), torch.from_numpy(anchors), block_size)
        t, s = text_walk(correct[anchors - first] & valid[:, 1:].numpy(), mask)
        tokens.append(t)
        steps.append(s)
    return tokens, steps


def walk_summary(tokens: list[int], steps: list[int]) -> dict:
    """A walk over held-out texts as the tools record it: its pooled tau and interval, and
    each text's counts (for paired intervals against another drafter or a baseline)."""
    from .intervals import pooled_interval

    return {"walk_tau": round(sum(tokens) / max(sum(steps), 1), 4), "walk_ci95": pooled_interval(tokens, steps),
            "walk_tokens": tokens, "walk_steps": steps}


def text_walk(correct: np.ndarray, mask: np.ndarray) -> tuple[int, int]:
    """One text's walk from its ``drafter_correct`` rows: tokens gained and verify steps,
    from the first completion token, each step jumping ``1 + leading correct``."""
    L = len(mask)
    accept = dict(zip(anchor_candidates(mask).tolist(), (1 + np.cumprod(correct, axis=1).sum(1)).tolist()))
    start, t, s = int(np.argmax(mask)), 0, 0
    while start + 1 < L:
        n = min(accept[start], L - start - 1)
        t, s, start = t + n, s + 1, start + n
    return t, s


def real_tau(drafter, target, prompts: list[torch.Tensor], max_new_tokens: int,
             stop_ids: tuple[int, ...] = (), check_lossless: str = "full", references: list | None = None,
             keep: list | None = None) -> dict:
    """Real speculative decoding of ``drafter`` from ``prompts``, all prompts' verify steps
    batched (``decode.speculative_generate_rows``: each prompt decodes as it would alone),
    summed up by ``decode_stats``.

    ``references``: the target's greedy texts of ``prompts`` to check losslessness
    against, if known; else ``check_lossless`` says how to get them: "full", cache-free
    greedy decoding (exact, slow), "cached", cached greedy decoding (what serving
    compares), "none" skips the check. ``keep``: a list that receives the ``Generation``
    of each prompt (``serve-check`` counts them as an engine does).
    """
    t = time.perf_counter()
    gens = speculative_generate_rows(DrafterBlocks(drafter, target, len(prompts)), target, prompts,
                                     max_new_tokens, verify_block(drafter), stop_ids)
    spec_s = time.perf_counter() - t
    if keep is not None:
        keep.extend(gens)
    if references is None:
        if check_lossless == "full":
            references = [cut_at_stop(greedy_generate(target, p, max_new_tokens), len(p), stop_ids) for p in prompts]
        elif check_lossless == "cached":
            references = [greedy_cached(target, p, max_new_tokens, stop_ids)[0] for p in prompts]
        else:
            references = [g.ids for g in gens]
    out = decode_stats(gens, [len(p) for p in prompts], max_new_tokens, verify_block(drafter), references)
    out["spec_s"] = round(spec_s, 2)
    out["mismatches"] = [divergence(target, g.ids, r, len(p)) | {"prompt": i}
                         for i, (g, r, p) in enumerate(zip(gens, references, prompts)) if not torch.equal(g.ids, r)]
    ties = sum(m["tie"] for m in out["mismatches"])
    out["lossless_up_to_ties"] = out["lossless_prompts"] + ties == len(gens)
    return out


# Two logits closer than this (relative to the larger) are a tie: the same forward in another
# shape (a verify block against one token, another batch) may order them either way. float32
# sums differ in their last few bits; half precision in its last one or two.
TIE_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@torch.no_grad()
def divergence(target, output: torch.Tensor, reference: torch.Tensor, prompt_len: int) -> dict:
    """Where decoding's ``output`` first leaves the ``reference`` text, and whether the target
    was tied there: the gap between the two tokens' logits after the shared prefix, from one
    cache-free forward. A lossless decoder differs from the reference only at such ties; a
    gap far above the tolerance is a decoding bug."""
    n = min(len(output), len(reference))
    diff = (output[:n] != reference[:n]).nonzero()
    at = int(diff[0]) if len(diff) else n
    if at == n:     # one stopped where the other went on: no two tokens to compare
        return {"at": at - prompt_len, "logit_gap": None, "tie": False}
    logits = target.logits_and_hidden(reference[:at][None].to(target.device))[0][0, -1]
    tol = TIE_TOLERANCE.get(logits.dtype, 1e-5)
    a, b = logits[int(output[at])].double(), logits[int(reference[at])].double()
    gap = float((a - b).abs())
    scale = float(torch.maximum(a.abs(), b.abs()))
    return {"at": at - prompt_len, "logit_gap": gap, "tie": gap <= tol * max(scale, 1.0)}


def decode_stats(gens: list[Generation], prompt_lens: list[int], max_new_tokens: int, block_size: int,
                 references: list) -> dict:
    """Real tau of generations, one per prompt.

    ``tau`` is z-lab's figure: per prompt the mean tokens per verify step (the last step
    in full), then the mean over prompts (``per_prompt``), with its 95% bootstrap interval
    over prompts (``tau_ci95``, ``eval.intervals``). ``tau_pooled`` pools every verify step;
    ``tau_clipped`` counts only tokens within ``max_new_tokens`` (what replaying
    simulated acceptances over the same text gives, see ``walk_tau``). ``lossless``
    compares each output with its entry of ``references``.
    """
    pooled, accepted = [], []
    clipped_tokens = clipped_steps = calls = generated = 0
    for g, P in zip(gens, prompt_lens):
        pooled += g.lengths
        accepted += g.accepted
        end = P + max_new_tokens
        inside = [(s, n) for s, n in zip(g.starts, g.lengths) if s < end - 1]
        clipped_tokens += sum(min(n, end - 1 - s) for s, n in inside)
        clipped_steps += len(inside)
        calls += g.target_calls
        generated += len(g.ids) - P
    lossless = sum(torch.equal(g.ids, r) for g, r in zip(gens, references))
    per_prompt = [float(np.mean(g.lengths)) for g in gens]
    return {"tau": float(np.mean(per_prompt)), "tau_ci95": mean_interval(per_prompt),
            "per_prompt": [round(t, 4) for t in per_prompt], "tau_pooled": float(np.mean(pooled)),
            "tau_clipped": clipped_tokens / max(1, clipped_steps),
            "per_position": conditional_acceptance(accepted, block_size - 1),
            "verify_steps": len(pooled), "prompts": len(gens),
            "lossless": lossless == len(gens), "lossless_prompts": lossless,
            "generated_tokens": generated, "tokens_per_target_call": generated / max(calls, 1)}


@dataclass
class TargetTexts:
    """The target's greedy continuation of each prompt, computed once for every proposer."""

    prompts: list[torch.Tensor]
    texts: list[torch.Tensor]
    """Prompt and ``max_new_tokens + block_size - 1`` greedy tokens, past stop tokens:
    as far as a verify step of the last block sees (what ``replay`` needs)."""
    references: list[torch.Tensor]
    """``texts`` cut as decoding's output is: at ``max_new_tokens``, after a stop token."""
    max_new_tokens: int
    stop_ids: tuple[int, ...]

    @classmethod
    def greedy(cls, target, prompts: list[torch.Tensor], max_new_tokens: int, block_size: int,
               stop_ids: tuple[int, ...]) -> "TargetTexts":
        texts = greedy_rows(target, prompts, max_new_tokens + block_size - 1)
        refs = [cut_at_stop(t[:len(p) + max_new_tokens], len(p), stop_ids) for p, t in zip(prompts, texts)]
        return cls(prompts, texts, refs, max_new_tokens, stop_ids)


def replayed_tau(rows: list[tuple[np.ndarray, np.ndarray]], tt: TargetTexts, block_size: int) -> dict:
    """``decode_stats`` of speculative decoding replayed (``decode.replay``) on the target's
    texts, from a proposer's per-prompt ``(correct, valid)`` over ``tt.texts``: what decoding
    the prompts for real gives, at the cost of the proposer alone. Its output is the
    target's text by construction, so its ``lossless`` holds trivially: decoding for real
    (``real_tau``) is what can prove it."""
    lens = [len(p) for p in tt.prompts]
    gens = [replay(c, t, P, tt.max_new_tokens, tt.stop_ids) for (c, _), t, P in zip(rows, tt.texts, lens)]
    return decode_stats(gens, lens, tt.max_new_tokens, block_size, tt.references)


def clip_rows(correct: np.ndarray, valid: np.ndarray, prompt_len: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-anchor rows over a text (anchors ``prompt_len..``) cut to its first ``length``
    tokens: what ``drafter_correct`` / ``proposer_correct`` give on the shorter text."""
    n = max(length - 1 - prompt_len, 0)
    inside = prompt_len + np.arange(n)[:, None] + 1 + np.arange(correct.shape[1])[None] < length
    return correct[:n] & inside, valid[:n] & inside


def completion_entropy(dataset) -> float:
    """Mean per-sample entropy (bits) of the supervised tokens' unigram distribution."""
    ent = []
    for i in range(len(dataset)):
        ids, mask = dataset.sample(i)
        _, c = np.unique(ids[mask.astype(bool)], return_counts=True)
        q = c / c.sum()
        ent.append(float(-(q * np.log2(q)).sum()))
    return float(np.mean(ent))


def evaluate_drafter(cfg, state_dict=None, max_new_tokens: int = 64) -> dict:
    """Held-out metrics of a drafter (``state_dict`` None = the untrained baseline).

    The held-out prompts are continued by the target for ``max_new_tokens`` greedy
    tokens (cached next to the target); simulated tau is measured on that text and
    real tau by speculative decoding from the same prompts for the same length, so the
    two see the same tokens. Simulated tau on the raw held-out data is reported too.
    """
    torch.set_num_threads(cfg.train.num_threads)
    target = load_target(cfg, "cpu")
    drafter = build_drafter(cfg, target)
    if state_dict is not None:
        drafter.load_state_dict(state_dict)
    drafter.eval()
    heldout = open_dataset(cfg.data, progress=False, path=ensure_synthetic_dataset(cfg.data)[1])
    tdir = ensure_target(cfg)
    regen_dir = tdir.with_name(f"{tdir.name}-heldout-greedy{max_new_tokens}")
    if not (regen_dir / "state.json").is_file():
        regenerate(target, heldout, regen_dir, completion_len=max_new_tokens)
    regen = open_dataset(cfg.data, progress=False, path=regen_dir)
    return {"simulated_target_text": simulated_tau(drafter, target, regen, cfg),
            "real": real_tau(drafter, target, [p for p, _ in prompts_of(regen)], max_new_tokens),
            "walk_tau_target_text": walk_tau(drafter, target, regen),
            "simulated_heldout_data": simulated_tau(drafter, target, heldout, cfg),
            "target_text_entropy_bits": completion_entropy(regen)}


@torch.no_grad()
def completion_mask(length: int, prompt_len: int) -> np.ndarray:
    """Loss mask of a prompt followed by its completion: 1 on the completion only."""
    mask = np.zeros(length, np.int8)
    mask[prompt_len:] = 1
    return mask


@torch.no_grad()
def text_features(target, ids: torch.Tensor) -> torch.Tensor:
    """Target features ``[L, k*H]`` of one whole text, as training computes them."""
    L = len(ids)
    batch = Batch(ids.to(target.device), torch.arange(L, device=target.device),
                  torch.ones(L, dtype=torch.int8, device=target.device), torch.tensor([0, L], dtype=torch.int32), L)
    return target.features(batch)


@torch.no_grad()
def drafter_correct(drafter, target, ids: torch.Tensor, mask: np.ndarray,
                    feats: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(correct, valid)`` ``[A, B-1]``: per anchor (``anchor_candidates(mask)``), whether
    each draft slot (a DFlash2's: its selector's choice; a DSpark's: ``[A, B]``, every slot
    its Markov-biased argmax after the text's token before it; an XPress's: its Jacobi
    drafts, ``_jacobi_correct``) equals the text, up to the first
    slot that does not (every later one reads False: no metric counts past it, and
    skipping its vocabulary head, most of the cost, makes this several times cheaper for
    a drafter that accepts little). This is the
    training objective's view: the features of the whole text (``feats``,
    ``text_features`` if not given), each block seeing only the positions before its anchor."""
    ids_t = ids.to(target.device)
    anchors = torch.from_numpy(anchor_candidates(mask)).to(target.device)
    feats = text_features(target, ids_t) if feats is None else feats.to(target.device)
    hidden = block_hidden(drafter, target.embed_tokens, drafter.context(feats.to(drafter.fc.weight.dtype)),
                          ids_t, anchors).to(target.dtype)
    shift = getattr(drafter, "label_shift", 0)
    labels, valid = block_labels(ids_t, torch.from_numpy(mask).to(target.device), anchors, drafter.block_size, shift)
    if getattr(drafter, "refiner_head", None) is not None:
        return _jacobi_correct(drafter, target, hidden, ids_t, anchors, labels, valid)
    correct = torch.zeros_like(valid)
    first = 1 - shift                   # a DFlash's slot 0 is the anchor itself, never a draft
    alive = valid[:, first]
    selector, markov = drafter.candidate_selector, getattr(drafter, "markov_head", None)
    for k in range(first, drafter.block_size):
        rows = alive.nonzero()[:, 0]
        if not len(rows):
            break
        # Padded to EXACT_ROWS so that each row's logits are those of the whole-text head.
        padded = torch.cat([rows, rows[:1].expand(max(0, EXACT_ROWS - len(rows)))])
        logits = target.lm_head(hidden[padded, k])[:len(rows)]
        if markov is not None:
            # Every earlier slot of a live row is right: the text's token before is the walk's.
            picked = (logits.float() + markov.bias(markov.embed(ids_t[anchors[rows] + k]))).argmax(-1)
        elif selector is None:
            picked = logits.argmax(-1)
        else:
            # Every earlier slot of a live row is right: its gold predecessor is the walk's.
            unary, cand = logits.topk(selector.top_k, dim=-1)
            s = selector.scores(hidden[rows, k], unary, cand, labels[rows, k - 1])
            picked = cand.gather(1, s.argmax(-1, keepdim=True))[:, 0]
        correct[rows, k] = picked == labels[rows, k]
        if k + 1 < drafter.block_size:
            alive = correct[:, k] & valid[:, k + 1]
    return correct[:, first:].cpu().numpy(), valid[:, first:].cpu().numpy()


JACOBI_BLOCKS = 64
"""Blocks whose ``[B-1, vocab]`` logits exist at once in ``_jacobi_correct``."""


def _jacobi_correct(drafter, target, hidden, ids, anchors, labels, valid) -> tuple[np.ndarray, np.ndarray]:
    """``drafter_correct`` of an XPress: its rule is decoding's, every slot drafted at once
    by ``num_jacobi_passes`` Jacobi rounds (``models.xpress.jacobi``), so the whole block's
    drafts are made, then cut at the first wrong slot."""
    passes = xpress_sizes(drafter.config)["num_jacobi_passes"]
    before = ids[anchors]       # slot 0 reads the anchor, as decoding and vLLM 0.33 do (``models.xpress``)
    drafts = []
    for s in range(0, len(anchors), JACOBI_BLOCKS):
        sl = slice(s, s + JACOBI_BLOCKS)
        base = target.lm_head(hidden[sl, 1:])
        drafts.append(jacobi(drafter.refiner_head, hidden[sl].to(drafter.fc.weight.dtype), base, before[sl],
                             ids[anchors[sl]], passes))
    pred = torch.cat(drafts) if drafts else labels[:, 1:]
    correct = ((pred == labels[:, 1:]) & valid[:, 1:]).long().cumprod(dim=1).bool()
    return correct.cpu().numpy(), valid[:, 1:].cpu().numpy()


def proposer_correct(propose, ids: torch.Tensor, prompt_len: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``drafter_correct`` for a proposer that needs no target features (baselines)."""
    rows, valid = [], []
    for a in range(prompt_len, len(ids) - 1):
        draft = propose(ids[:a + 1], None)[:block_size - 1]
        want = ids[a + 1:a + block_size]
        ok = np.zeros(block_size - 1, bool)
        ok[:len(want)] = (draft[:len(want)] == want).cpu().numpy()
        v = np.zeros(block_size - 1, bool)
        v[:len(want)] = True
        rows.append(ok)
        valid.append(v)
    return np.array(rows).reshape(-1, block_size - 1), np.array(valid).reshape(-1, block_size - 1)


def text_metrics(correct: np.ndarray, valid: np.ndarray) -> dict:
    """Simulated tau (1 + leading correct slots, averaged over anchors) and per slot the
    conditional acceptance P(slot k right | slots < k right), among anchors whose slot k
    lies inside the text."""
    lead = np.cumprod(correct, axis=1)
    reached = np.concatenate([np.ones((len(correct), 1), bool), lead[:, :-1].astype(bool)], axis=1) & valid
    per_slot = [round(float(lead[reached[:, k], k].mean()), 4) if reached[:, k].any() else None
                for k in range(correct.shape[1])]
    return {"tau": float(1 + lead.sum(1).mean()) if len(lead) else 1.0, "per_position": per_slot,
            "anchors": int(len(correct))}
