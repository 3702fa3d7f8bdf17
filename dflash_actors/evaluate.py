"""Held-out evaluation: simulated tau from the training objective, and real tau from
greedy speculative decoding against the target.

* Simulated tau puts an anchor at *every* candidate position (``m[a] = m[a+1] = 1``)
  of the held-out set, so it does not depend on the anchor sampler: 1 + leading
  correct slots, averaged over blocks.
* Real tau follows z-lab's ``dflash_generate`` at temperature 0: draft a block from the
  verified prefix, verify it with one target forward, accept the longest matching
  prefix plus the target's bonus token; tau = mean tokens produced per verify step.
  Both models run the whole prefix each step (no KV cache): slower, but trivially
  exact, and the output must equal the target's own greedy text.
* Drafters are trained on data tokens but judged on the target's greedy text, so the
  two taus agree only on target-generated data: ``regenerate`` rewrites a dataset's
  completions with the target's greedy continuation of each prompt.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from dflash_actors.batching import Batch, BatchBuffers, assemble, plan_for
from dflash_actors.data import open_dataset
from dflash_actors.models.drafter import build_drafter, sdpa_dense
from dflash_actors.models.loss import (
    all_anchors,
    anchor_candidates,
    block_hidden,
    block_labels,
    decay_gamma,
    dflash_loss,
)
from dflash_actors.synthetic import flatten, write_token_dataset


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
        ids_t = torch.from_numpy(ids).to(target.device)
        batch = Batch(ids_t, torch.arange(L, device=target.device), torch.from_numpy(mask).to(target.device),
                      torch.tensor([0, L], dtype=torch.int32), L)
        anchors = torch.from_numpy(anchor_candidates(mask)).to(target.device)
        hidden = block_hidden(drafter, target.embed_tokens, drafter.context(target.features(batch)), ids_t, anchors)
        labels, valid = block_labels(ids_t, batch.loss_mask, anchors, drafter.block_size)
        correct = (target.lm_head(hidden.to(target.dtype)).argmax(-1) == labels) & valid
        accept = dict(zip(anchors.tolist(), (1 + correct[:, 1:].long().cumprod(1).sum(1)).tolist()))
        start = int(np.argmax(mask))
        while start + 1 < L:
            n = min(accept[start], L - start - 1)
            tokens, steps, start = tokens + n, steps + 1, start + n
    return tokens / max(steps, 1)


@torch.no_grad()
def greedy_generate(target, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The target's own greedy continuation ``[P + max_new_tokens]``."""
    ids = prompt.to(target.device)
    for _ in range(max_new_tokens):
        logits, _ = target.logits_and_hidden(ids[None])
        ids = torch.cat([ids, logits[0, -1].argmax()[None]])
    return ids


def drafter_proposer(drafter, target):
    """``propose(ids, feats)`` for ``speculative_generate``: the drafter's greedy block.

    ``ids[-1]`` is the anchor (verified, no target state yet) and ``feats`` the target
    features of every position before it, so the drafter sees exactly what training's
    ``< a`` mask shows it; no mask is needed.
    """
    B = drafter.block_size

    def propose(ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        start = len(ids) - 1
        ctx = drafter.context(feats.to(drafter.fc.weight.dtype))
        block = torch.full((B,), drafter.mask_token_id, dtype=torch.long, device=ids.device)
        block[0] = ids[-1]
        positions = torch.arange(start + B, device=ids.device)
        noise = target.embed_tokens(block)[None].to(ctx.dtype)
        hidden = drafter(noise, ctx[None], positions[None], sdpa_dense(None))[0, 1:]
        return target.lm_head(hidden.to(target.dtype)).argmax(-1)
    return propose


@torch.no_grad()
def speculative_generate(propose, target, prompt: torch.Tensor, max_new_tokens: int,
                         block_size: int) -> tuple[torch.Tensor, list[int]]:
    """Greedy draft-then-verify; returns ``(ids [P + max_new_tokens], tokens per verify step)``."""
    P = len(prompt)
    end = P + max_new_tokens
    ids = prompt.to(target.device)
    logits, feats = target.logits_and_hidden(ids[None])
    ids = torch.cat([ids, logits[0, -1].argmax()[None]])
    start, produced = P, []   # ids[start] is verified but has no target state yet: the anchor
    while start + 1 < end:
        draft = propose(ids[:start + 1], feats[0, :start])[:block_size - 1]
        candidate = torch.cat([ids[:start + 1], draft])
        logits, feats = target.logits_and_hidden(candidate[None])
        posterior = logits[0, start:].argmax(-1)       # the target's tokens for start+1 ..
        accepted = int((draft == posterior[:-1]).long().cumprod(0).sum())
        n = min(accepted + 1, end - start - 1)
        ids = torch.cat([ids[:start + 1], draft[:accepted], posterior[accepted:accepted + 1]])[:start + 1 + n]
        start += n
        produced.append(n)
    return ids[:end], produced


def real_tau(drafter, target, prompts: list[torch.Tensor], max_new_tokens: int) -> dict:
    """Mean tokens per verify step over ``prompts``, and whether every output equalled
    the target's own greedy text."""
    steps, lossless = [], True
    propose = drafter_proposer(drafter, target)
    for p in prompts:
        out, produced = speculative_generate(propose, target, p, max_new_tokens, drafter.block_size)
        steps += produced
        lossless &= bool(torch.equal(out, greedy_generate(target, p, max_new_tokens)))
    return {"tau": float(np.mean(steps)), "verify_steps": len(steps), "lossless": lossless}


def prompts_of(dataset) -> list[tuple[torch.Tensor, int]]:
    """``(prompt, completion length)`` per sample: the prompt is everything before the first supervised token."""
    out = []
    for i in range(len(dataset)):
        ids, mask = dataset.sample(i)
        first = int(np.argmax(mask)) if mask.any() else len(ids)
        out.append((torch.from_numpy(ids[:max(first, 1)]), len(ids) - max(first, 1)))
    return out


@torch.no_grad()
def regenerate(target, dataset, out_dir: str | Path, completion_len: int | None = None) -> Path:
    """A copy of ``dataset`` whose completions are the target's greedy text, of the
    original lengths or all of ``completion_len``.

    Prompts of equal length are generated together with a KV cache (no padding, so no
    attention mask is needed); this is data preparation, not the lossless check.
    """
    items = [(p, completion_len or n) for p, n in prompts_of(dataset)]
    by_len: dict[int, list[int]] = {}
    for i, (p, _) in enumerate(items):
        by_len.setdefault(len(p), []).append(i)
    seqs: list[np.ndarray] = [np.zeros(0, np.int64)] * len(items)
    for idx in by_len.values():
        for s in range(0, len(idx), 256):
            group = idx[s:s + 256]
            prompt = torch.stack([items[i][0] for i in group]).to(target.device)
            n = max(items[i][1] for i in group)
            out = target.model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                        pad_token_id=0, eos_token_id=None).cpu().numpy()
            for r, i in enumerate(group):
                seqs[i] = out[r, :prompt.shape[1] + items[i][1]]
    masks = [np.concatenate([np.zeros(len(p), np.int8), np.ones(n, np.int8)]) for p, n in items]
    offsets, flat = flatten(seqs)
    return write_token_dataset(out_dir, offsets, flat, flatten(masks)[1])


def ensure_target_text(cfg) -> Path:
    """The training split with the target's greedy completions (the DFlash recipe:
    drafters learn the target's text, not the data's), built once next to the target."""
    from dflash_actors.models.target import ensure_target, load_target
    from dflash_actors.preflight import train_path

    tdir = ensure_target(cfg)
    src = train_path(cfg)
    out = tdir.with_name(f"{tdir.name}-greedy-{hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:8]}")
    if not (out / "state.json").is_file():
        torch.set_num_threads(cfg.train.num_threads)
        regenerate(load_target(cfg, "cuda:0" if torch.cuda.is_available() else "cpu"),
                   open_dataset(cfg.data, progress=False, path=src), out)
    return out


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
    from dflash_actors.models.target import ensure_target, load_target
    from dflash_actors.synthetic import ensure_synthetic_dataset

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
