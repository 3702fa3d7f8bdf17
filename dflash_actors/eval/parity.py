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
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..data.batching import Batch, BatchBuffers, assemble, plan_for
from ..data.dataset import open_dataset
from ..models.drafter import build_drafter
from ..models.loss import (
    all_anchors,
    anchor_candidates,
    block_hidden,
    block_labels,
    decay_gamma,
    dflash_loss,
)
from ..data.synthetic import flatten, write_token_dataset


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
    from ..models.target import ensure_target, load_target
    from ..job.preflight import train_path

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
    from ..models.target import ensure_target, load_target
    from ..data.synthetic import ensure_synthetic_dataset

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


# ---------------------------------------------------------------------------
# train/serve parity on real prompts: simulated and real tau on the same text


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


def parity(name: str, drafter, target, prompts: list[torch.Tensor], max_new_tokens: int,
           stop_ids: tuple[int, ...], propose_for=None, references: list | None = None) -> dict:
    """Real tau by speculative decoding from ``prompts`` and simulated tau on the very
    text it produced (the target's greedy text when lossless), side by side.
    ``drafter`` drafts unless ``propose_for(prompt)`` gives a baseline's proposer; its
    block size applies either way. ``references``: the target's cached greedy texts of
    ``prompts``, if already known (they do not depend on the drafter)."""
    B = drafter.block_size
    texts: list[torch.Tensor] = []
    real = real_tau(drafter, target, prompts, max_new_tokens, stop_ids, propose_for, "cached", texts, references)
    correct, valid = [], []
    for p, text in zip(prompts, texts):
        if propose_for is None:
            c, v = drafter_correct(drafter, target, text, completion_mask(len(text), len(p)))
        else:
            c, v = proposer_correct(propose_for(p), text, len(p), B)
        correct.append(c)
        valid.append(v)
    sim = text_metrics(np.concatenate(correct), np.concatenate(valid))
    gap = abs(sim["tau"] - real["tau"]) / real["tau"]
    return {"name": name, "real": real, "simulated": sim, "sim_vs_real": round(gap, 4),
            "parity_warning": gap > PARITY_WARN}


PARITY_WARN = 0.15
"""Simulated and real tau further apart than this (relative) are reported as a warning:
training's acceptance then does not predict serving's."""


# ---------------------------------------------------------------------------
# command line


def resolve_drafter_dir(path: str | Path) -> Path:
    """A drafter directory, a checkpoint (``step-N``) or a run directory (its latest checkpoint)."""
    from ..train.checkpoint import latest_checkpoint
    from ..models.drafter import WEIGHTS

    p = Path(path)
    if (p / "config.json").is_file() and (p / WEIGHTS).is_file():
        return p
    ckpt = latest_checkpoint(p) if p.is_dir() else None
    if ckpt is None:
        raise ValueError(f"CHECKPOINT: {p} is not a drafter directory, a checkpoint or a run directory with one")
    return ckpt


def saved_run_config(drafter_dir: Path) -> dict | None:
    """The training config stored beside a checkpoint's drafter, if any."""
    from ..train.checkpoint import STATE_FILE, load_trainer_state

    return load_trainer_state(drafter_dir).get("config") if (drafter_dir / STATE_FILE).is_file() else None


def load_parity_target(target_path: str, layer_ids: list[int], cache_dir: str = ".cache"):
    """``(TargetModel, tokenizer)`` on CPU in float32, exposing ``layer_ids``."""
    from transformers import AutoModelForCausalLM

    from ..models.target import TargetModel, resolve_target_dir
    from .prepare import load_tokenizer

    tdir = resolve_target_dir(target_path, None, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32, attn_implementation="sdpa")
    return TargetModel(model, layer_ids), load_tokenizer(tdir)


def check_template(tokenizer, opts: dict, dataset_dir: Path | None) -> str:
    """Refuse prompts templated unlike the training data (``prepare.json``); say what was checked."""
    from .prepare import PrepareError, TemplateSettings, read_metadata, template_settings

    mine = template_settings(tokenizer, **opts)
    meta = read_metadata(dataset_dir) if dataset_dir is not None else None
    if meta is None:
        return "not checked (the training dataset has no prepare.json)"
    theirs = TemplateSettings(**meta["template"])
    bad = mine.describe_mismatch(theirs)
    if bad:
        raise PrepareError(f"chat template mismatch with {dataset_dir}: {bad} "
                           "(pass the dataset's --thinking/--system-prompt, or evaluate with its target)")
    return f"matches {dataset_dir}"


def evaluate_real(drafter_dir: str | Path, prompts_path: str | Path, *, target_path: str | None = None,
                  dataset_dir: str | Path | None = None, template: dict | None = None, max_new_tokens: int = 64,
                  limit: int | None = None, baselines: tuple[str, ...] = ("untrained", "ngram", "repeat"),
                  threads: int | None = None, cache_dir: str = ".cache", log=print) -> dict:
    """The parity report of a trained drafter and its baselines on held-out chat prompts."""
    from ..models.drafter import DFlashDrafter
    from .prepare import encode_prompt, read_prompts, stop_ids, template_settings

    if threads:
        torch.set_num_threads(threads)
    ddir = resolve_drafter_dir(drafter_dir)
    run_cfg = saved_run_config(ddir) or {}
    target_path = target_path or (run_cfg.get("target") or {}).get("path")
    if target_path is None:
        raise ValueError("--target: needed (the checkpoint does not name its target)")
    if dataset_dir is None and (run_cfg.get("data") or {}).get("path"):
        dataset_dir = run_cfg["data"]["path"]
    dataset_dir = Path(dataset_dir) if dataset_dir else None
    drafter = DFlashDrafter.from_pretrained(ddir).eval()
    target, tokenizer = load_parity_target(target_path, drafter.target_layer_ids, cache_dir)
    if target.hidden_size != drafter.config.hidden_size:
        raise ValueError(f"--target: hidden size {target.hidden_size}, the drafter was trained for "
                         f"{drafter.config.hidden_size}")
    opts = template or {"enable_thinking": False, "system_prompt": None}
    checked = check_template(tokenizer, opts, dataset_dir)
    settings = template_settings(tokenizer, **opts)
    prompts = [torch.tensor(encode_prompt(tokenizer, m, settings)) for m in read_prompts(prompts_path)[:limit]]
    stops = tuple(stop_ids(tokenizer, target.model))
    B = drafter.block_size
    runs: dict = {"trained": (drafter, None)}
    if "untrained" in baselines:
        seed = int((run_cfg.get("train") or {}).get("seed", 0))
        runs["untrained"] = (DFlashDrafter(drafter.config).init_weights(seed).eval(), None)
    if "ngram" in baselines and dataset_dir is not None:
        ngram = NgramProposer(open_dataset(_data_cfg(), progress=False, path=dataset_dir), B)
        runs["ngram"] = (drafter, lambda p: ngram)
    if "repeat" in baselines:
        runs["repeat"] = (drafter, lambda p: repeat_proposer(B))
    out = {"drafter": str(ddir), "target": str(target_path), "prompts": str(prompts_path),
           "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "block_size": B,
           "template_check": checked, "tau_counting": TAU_COUNTING, "results": {}}
    t = time.perf_counter()
    references, greedy_calls = [], 0
    for p in prompts:
        text, calls = greedy_cached(target, p, max_new_tokens, stops)
        references.append(text)
        greedy_calls += calls
    out["greedy"] = {"tokens_per_target_call": sum(len(r) - len(p) for r, p in zip(references, prompts))
                     / max(greedy_calls, 1), "wall_s": round(time.perf_counter() - t, 1)}
    for name, (d, propose_for) in runs.items():
        t = time.perf_counter()
        r = parity(name, d, target, prompts, max_new_tokens, stops, propose_for, references)
        r["wall_s"] = round(time.perf_counter() - t, 1)
        out["results"][name] = r
        log(f"evaluate: {name}: real tau {r['real']['tau']:.3f}, simulated tau {r['simulated']['tau']:.3f} "
            f"({r['wall_s']:.0f} s)")
    return out


TAU_COUNTING = ("real tau as z-lab's benchmark counts it: per prompt the mean tokens per verify step "
                "(accepted drafts + 1, the last step in full), then the mean over prompts; "
                "tau_pooled pools every step of every prompt")


def _data_cfg():
    from ..config import DataConfig

    return DataConfig(max_seq_len=1 << 20)


def format_report(report: dict) -> str:
    """The side-by-side table ``evaluate`` prints."""
    lines = [f"drafter {report['drafter']} on {report['num_prompts']} prompts, {report['max_new_tokens']} new tokens; "
             f"chat template {report['template_check']}",
             f"{'':10} {'real tau':>8} {'pooled':>7} {'sim tau':>8} {'gap':>6} {'tok/call':>8} {'lossless':>9}  "
             "real per-position acceptance (slot 1..)"]
    for name, r in report["results"].items():
        real, sim = r["real"], r["simulated"]
        pos = " ".join("-" if x is None else f"{x:.2f}" for x in real["per_position"][:8])
        lines.append(f"{name:10} {real['tau']:8.3f} {real['tau_pooled']:7.3f} {sim['tau']:8.3f} "
                     f"{r['sim_vs_real']:6.1%} {real['tokens_per_target_call']:8.2f} "
                     f"{real['lossless_prompts']:>4}/{real['prompts']:<4}  {pos}")
    g = report["greedy"]
    lines.append(f"plain greedy decoding (KV cache): {g['tokens_per_target_call']:.2f} tokens per target call, "
                 f"{g['wall_s']:.0f} s. " + report["tau_counting"] + ".")
    for name, r in report["results"].items():
        if r["parity_warning"] and name == "trained":
            lines.append(f"warning: {name}: simulated tau {r['simulated']['tau']:.2f} and real tau "
                         f"{r['real']['tau']:.2f} differ by {r['sim_vs_real']:.0%} (> {PARITY_WARN:.0%}): "
                         "training's acceptance does not predict serving's; check the chat template, "
                         "thinking mode and target layers")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import json
    import sys

    from transformers.utils import logging as hf_logging

    from .prepare import add_template_args, template_opts

    ap = argparse.ArgumentParser(prog="python -m dflash_actors.evaluate",
                                 description="Simulated against real acceptance of a drafter on held-out prompts")
    ap.add_argument("checkpoint", help="drafter directory, checkpoint step-N, or run directory")
    ap.add_argument("--prompts", required=True, help="held-out JSONL chat prompts or text lines")
    ap.add_argument("--target", help="target path or pkg:NAME (default: the one the run trained against)")
    ap.add_argument("--dataset", help="the training dataset, for its template metadata and the n-gram "
                                      "baseline (default: the run's data.path)")
    add_template_args(ap)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, help="only the first N prompts")
    ap.add_argument("--baselines", default="untrained,ngram,repeat", help="comma list, or none")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--cache-dir", default=".cache")
    ap.add_argument("--json", help="also write the full report here")
    args = ap.parse_args(argv)
    hf_logging.disable_progress_bar()
    try:
        report = evaluate_real(args.checkpoint, args.prompts, target_path=args.target, dataset_dir=args.dataset,
                               template=template_opts(args), max_new_tokens=args.max_new_tokens, limit=args.limit,
                               baselines=tuple(b for b in args.baselines.split(",") if b and b != "none"),
                               threads=args.threads, cache_dir=args.cache_dir,
                               log=lambda m: print(m, file=sys.stderr))
    except (ValueError, OSError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
