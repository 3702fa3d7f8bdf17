"""Acceptance length tau, simulated from the training objective and real from decoding.

* Simulated tau puts an anchor at *every* candidate position (``m[a] = m[a+1] = 1``)
  of a text, so it does not depend on the anchor sampler: 1 + leading correct draft
  slots, averaged over blocks (``simulated_tau`` over a dataset in batches,
  ``drafter_correct`` + ``text_metrics`` over one text).
* Real tau is what ``decode.speculative_generate`` achieves: tokens per verify step,
  counted as z-lab's benchmark counts them (``real_tau``).
* The two agree only on the target's own text, since decoding visits the target's
  greedy continuation: ``evaluate_drafter`` measures both on held-out prompts
  continued by the target (``prepare.regenerate``), and ``walk_tau`` replays real
  decoding's walk on simulated acceptances.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..data.batching import Batch, BatchBuffers, assemble, plan_for
from ..data.dataset import open_dataset
from ..data.synthetic import ensure_synthetic_dataset
from ..models.drafter import build_drafter
from ..models.loss import all_anchors, anchor_candidates, block_hidden, block_labels, decay_gamma, dflash_loss
from ..models.target import ensure_target, load_target
from .decode import (
    conditional_acceptance,
    cut_at_stop,
    drafter_proposer,
    greedy_cached,
    greedy_generate,
    speculative_generate,
)
from .prepare import prompts_of, regenerate


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
    tokens = steps = 0
    for i in range(len(dataset)):
        ids, mask = dataset.sample(i)
        L = len(ids)
        correct, _ = drafter_correct(drafter, target, torch.from_numpy(ids), mask)
        accept = dict(zip(anchor_candidates(mask).tolist(), (1 + np.cumprod(correct, axis=1).sum(1)).tolist()))
        start = int(np.argmax(mask))
        while start + 1 < L:
            n = min(accept[start], L - start - 1)
            tokens, steps, start = tokens + n, steps + 1, start + n
    return tokens / max(steps, 1)


def real_tau(drafter, target, prompts: list[torch.Tensor], max_new_tokens: int,
             stop_ids: tuple[int, ...] = (), propose_for=None, check_lossless: str = "full",
             texts: list | None = None, references: list | None = None) -> dict:
    """Real speculative decoding over ``prompts``.

    ``tau`` is z-lab's figure: per prompt the mean tokens per verify step (the last step
    in full), then the mean over prompts. ``tau_pooled`` pools every verify step;
    ``tau_clipped`` counts only tokens within ``max_new_tokens`` (what replaying
    simulated acceptances over the same text gives, see ``walk_tau``).
    ``check_lossless``: "full" compares with cache-free greedy decoding (exact, slow),
    "cached" with cached greedy decoding (what serving compares), "none" skips it.
    """
    per_prompt, pooled, accepted = [], [], []
    clipped_tokens = clipped_steps = 0
    lossless, calls, generated = 0, 0, 0
    t_spec = 0.0
    B = drafter.block_size
    for p in prompts:
        propose = propose_for(p) if propose_for is not None else drafter_proposer(drafter, target)
        t = time.perf_counter()
        g = speculative_generate(propose, target, p, max_new_tokens, B, stop_ids)
        t_spec += time.perf_counter() - t
        per_prompt.append(float(np.mean(g.lengths)))
        pooled += g.lengths
        accepted += g.accepted
        end = len(p) + max_new_tokens
        inside = [(s, n) for s, n in zip(g.starts, g.lengths) if s < end - 1]
        clipped_tokens += sum(min(n, end - 1 - s) for s, n in inside)
        clipped_steps += len(inside)
        calls += g.target_calls
        generated += len(g.ids) - len(p)
        if references is not None:
            want = references[len(per_prompt) - 1]
        elif check_lossless == "full":
            want = cut_at_stop(greedy_generate(target, p, max_new_tokens), len(p), stop_ids)
        elif check_lossless == "cached":
            want, _ = greedy_cached(target, p, max_new_tokens, stop_ids)
        else:
            want = g.ids
        lossless += bool(torch.equal(g.ids, want))
        if texts is not None:
            texts.append(want)
    return {"tau": float(np.mean(per_prompt)), "tau_pooled": float(np.mean(pooled)),
            "tau_clipped": clipped_tokens / max(1, clipped_steps),
            "per_position": conditional_acceptance(accepted, B - 1),
            "verify_steps": len(pooled), "prompts": len(prompts),
            "lossless": lossless == len(prompts), "lossless_prompts": lossless,
            "generated_tokens": generated, "tokens_per_target_call": generated / max(calls, 1),
            "spec_s": round(t_spec, 2)}


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
def drafter_correct(drafter, target, ids: torch.Tensor, mask: np.ndarray,
                    feats: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(correct, valid)`` ``[A, B-1]``: per anchor (``anchor_candidates(mask)``), whether
    each draft slot equals the text. This is the training objective's view: the features
    of the whole text (``feats``, computed here if not given), each block seeing only the
    positions before its anchor."""
    ids_t = ids.to(target.device)
    L = len(ids)
    batch = Batch(ids_t, torch.arange(L, device=target.device), torch.from_numpy(mask).to(target.device),
                  torch.tensor([0, L], dtype=torch.int32), L)
    anchors = torch.from_numpy(anchor_candidates(mask)).to(target.device)
    feats = target.features(batch) if feats is None else feats.to(target.device)
    hidden = block_hidden(drafter, target.embed_tokens, drafter.context(feats.to(drafter.fc.weight.dtype)),
                          ids_t, anchors)
    labels, valid = block_labels(ids_t, batch.loss_mask, anchors, drafter.block_size)
    correct = (target.lm_head(hidden.to(target.dtype)).argmax(-1) == labels) & valid
    return correct[:, 1:].cpu().numpy(), valid[:, 1:].cpu().numpy()


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
