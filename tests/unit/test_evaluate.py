from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_actors.data.dataset import open_dataset
from dflash_actors.data.synthetic import ensure_synthetic_dataset, flatten, write_token_dataset
from dflash_actors.eval.decode import (
    conditional_acceptance,
    drafter_proposer,
    greedy_cached,
    greedy_generate,
    speculative_generate,
)
from dflash_actors.eval.tau import completion_entropy, divergence, real_tau, simulated_tau, walk_tau
from dflash_actors.models.drafter import sdpa_dense
from dflash_actors.models.drafter_start import build_drafter
from dflash_actors.prepare.regenerate import regenerate
from tests.support.fitting import fit_briefly, heldout_prompts

ROOT = Path(__file__).resolve().parents[2]

B = 8


@pytest.fixture(scope="module")
def setup(tiny):
    cfg, target = tiny
    return cfg, target, build_drafter(cfg, target)


def oracle(target, corrupt_slot=None):
    """Proposes the target's own greedy tokens, optionally one of them wrong."""
    def propose(ids, feats):
        draft = greedy_generate(target, ids, B - 1)[len(ids):]
        if corrupt_slot is not None:
            draft[corrupt_slot] = (draft[corrupt_slot] + 1) % target.vocab_size
        return draft
    return propose


PROMPT = torch.tensor([5, 17, 99, 42, 8, 140, 63])


def test_perfect_drafts_accept_whole_blocks(setup):
    _, target, _ = setup
    want = greedy_generate(target, PROMPT, 30)
    g = speculative_generate(oracle(target), target, PROMPT, 30, B)
    assert torch.equal(g.ids, want)
    # The first token comes from the prefill, then 8 per verify step; z-lab counts the
    # last step in full although only 5 of its tokens fit in 30.
    assert g.lengths == [8, 8, 8, 8] and g.target_calls == 5
    assert g.starts == [len(PROMPT) + 8 * i for i in range(4)]


def test_stop_token_ends_generation(setup):
    _, target, _ = setup
    want = greedy_generate(target, PROMPT, 30)
    stop = int(want[len(PROMPT) + 11])
    first = len(PROMPT) + int((want[len(PROMPT):] == stop).nonzero()[0])
    g = speculative_generate(oracle(target), target, PROMPT, 30, B, stop_ids=(stop,))
    assert torch.equal(g.ids, want[:first + 1])
    cached, calls = greedy_cached(target, PROMPT, 30, (stop,))
    assert torch.equal(cached, want[:first + 1]) and calls == first + 1 - len(PROMPT)
    cached, calls = greedy_cached(target, PROMPT, 30)
    assert torch.equal(cached, want) and calls == 30


def test_conditional_acceptance_counts_steps_that_reached_the_slot():
    # accepted drafts per step: slot 1 reached by 4 steps, accepted by 3; slot 2 reached
    # by 3, accepted by 2; slot 3 reached by 2 and accepted by none.
    assert conditional_acceptance([0, 1, 2, 2], 4) == [0.75, pytest.approx(2 / 3, abs=1e-4), 0.0, None]


def test_wrong_drafts_still_give_the_target_text(setup):
    _, target, _ = setup
    g = speculative_generate(oracle(target, corrupt_slot=0), target, PROMPT, 20, B)
    assert torch.equal(g.ids, greedy_generate(target, PROMPT, 20)) and g.lengths == [1] * 20
    g = speculative_generate(oracle(target, corrupt_slot=2), target, PROMPT, 20, B)
    assert torch.equal(g.ids, greedy_generate(target, PROMPT, 20)) and g.lengths[:6] == [3] * 6


def test_drafter_decoding_is_lossless(setup):
    _, target, drafter = setup
    r = real_tau(drafter, target, [PROMPT, PROMPT[:3]], 24)
    assert r["lossless"] and 1.0 <= r["tau"] <= B and r["verify_steps"] >= 24 / B
    assert r["mismatches"] == [] and r["lossless_up_to_ties"]
    g = speculative_generate(drafter_proposer(drafter, target), target, PROMPT, 24, B)
    assert torch.equal(g.ids, greedy_generate(target, PROMPT, 24))


def test_divergence_names_the_first_differing_token_and_the_targets_gap_there(setup):
    _, target, _ = setup
    ref = greedy_generate(target, PROMPT, 10)
    at = len(PROMPT) + 4
    logits, _ = target.logits_and_hidden(ref[:at][None])
    runner_up = int(logits[0, -1].topk(2).indices[1])
    out = ref.clone()
    out[at] = runner_up
    d = divergence(target, out, ref, len(PROMPT))
    gap = float(logits[0, -1, ref[at]] - logits[0, -1, runner_up])
    assert d["at"] == 4 and d["logit_gap"] == pytest.approx(gap, rel=1e-4) and gap > 0
    assert d["tie"] is False     # the tiny target's top two are not within float32 rounding
    # An output that stops early has no differing token to weigh.
    assert divergence(target, ref[:at], ref, len(PROMPT)) == {"at": 4, "logit_gap": None, "tie": False}


@pytest.mark.parametrize("gap, tie", [(2e-5, True), (1e-3, False)])
def test_divergence_calls_a_gap_within_float32_rounding_a_tie(gap, tie):
    # A target whose two best next tokens (3 and 5) are gap apart at about 29.5 (the size
    # of SmolLM2's logits where a real decode left its reference by 9.5e-6).
    logits = torch.zeros(1, 4, 8)
    logits[0, :, 3], logits[0, :, 5] = 29.5, 29.5 - gap
    stub = type("Stub", (), {"device": "cpu",
                             "logits_and_hidden": lambda self, ids: (logits[:, :ids.shape[1]], None)})()
    ref, out = torch.tensor([1, 2, 3, 3, 7]), torch.tensor([1, 2, 3, 5])
    assert divergence(stub, out, ref, 2) == {"at": 1, "logit_gap": pytest.approx(gap, rel=0.1), "tie": tie}


def test_cached_drafter_blocks_equal_the_full_prefix_forward(setup):
    """The proposer's context cache changes cost, not drafts: its block logits equal a
    forward over the whole prefix, as training computes it."""
    _, target, drafter = setup
    ids = greedy_generate(target, PROMPT, 20)
    _, feats = target.logits_and_hidden(ids[None])
    propose = drafter_proposer(drafter, target)
    for start in (len(PROMPT), len(PROMPT) + 3, len(PROMPT) + 11):
        ctx = drafter.context(feats[0, :start])
        block = torch.full((B,), drafter.mask_token_id)
        block[0] = ids[start]
        full = drafter(target.embed_tokens(block)[None], ctx[None], torch.arange(start + B)[None], sdpa_dense(None))
        want = target.lm_head(full[0, 1:]).argmax(-1)
        assert torch.equal(propose(ids[:start + 1], feats[0, :start]), want)


def test_regenerate_writes_the_target_greedy_text(setup, tmp_path):
    cfg, target, drafter = setup
    heldout = open_dataset(cfg.data, progress=False, path=ensure_synthetic_dataset(cfg.data)[1])
    regen = open_dataset(cfg.data, progress=False, path=regenerate(target, heldout, tmp_path / "regen", 12))
    assert len(regen) == len(heldout)
    for i in (0, 3):
        ids, mask = regen.sample(i)
        src_ids, src_mask = heldout.sample(i)
        p = int(np.argmax(src_mask))
        assert np.array_equal(ids[:p], src_ids[:p]) and mask.tolist() == [0] * p + [1] * 12
        assert np.array_equal(ids, greedy_generate(target, torch.from_numpy(ids[:p]), 12).numpy())
    assert 0.0 < completion_entropy(regen) <= np.log2(12)
    untrained = simulated_tau(drafter, target, regen, cfg)
    assert 1.0 <= untrained["tau"] < 1.2 and untrained["blocks"] == 11 * len(regen)


def test_walk_over_simulated_acceptances_replays_real_decoding(setup, tmp_path):
    cfg, target, drafter = setup
    heldout = open_dataset(cfg.data, progress=False, path=ensure_synthetic_dataset(cfg.data)[1])
    regen = open_dataset(cfg.data, progress=False, path=regenerate(target, heldout, tmp_path / "regen", 16))
    prompts = [regen.sample(i)[0][:int(np.argmax(regen.sample(i)[1]))] for i in range(4)]
    real = real_tau(drafter, target, [torch.from_numpy(p) for p in prompts], 16)
    sub = tmp_path / "sub"
    ids, masks = zip(*(regen.sample(i) for i in range(4)))
    write_token_dataset(sub, *flatten(list(ids)), flatten(list(masks))[1])
    walked = walk_tau(drafter, target, open_dataset(cfg.data, progress=False, path=sub))
    assert walked == pytest.approx(real["tau_clipped"], abs=1e-9)


def test_evaluator_due_versions():
    from dflash_actors.eval.evaluator import due_versions
    assert due_versions(0, 18, 5) == [5, 10, 15, 18]
    assert due_versions(0, 15, 5) == [5, 10, 15]
    assert due_versions(7, 18, 5) == [10, 15, 18]      # a resumed run: only what is still ahead
    assert due_versions(0, 3, 5) == [3]


def test_evaluator_snapshot_discards_a_recycled_buffer():
    """Version v lives in buffer v % 2 until v + 2 is built there: a copy is whole while
    the version still reads v or v + 1 after it, and discarded afterwards."""
    from dflash_actors.eval.evaluator import snapshot
    from dflash_actors.train.params import ParamLayout, WeightStore
    layer = torch.nn.Linear(3, 2)
    store = WeightStore.allocate(ParamLayout.of(layer))
    params = list(layer.parameters())
    store.publish(4, params, None, None)
    assert torch.equal(snapshot(store, 4), store.weights[0])
    store.publish(5, params, None, None)
    assert snapshot(store, 4) is not None
    store.publish(6, params, None, None)
    assert snapshot(store, 4) is None


def test_plateau_compares_the_newest_evaluation_with_the_one_n_before():
    from dflash_actors.eval.evaluator import plateau, plateau_reason

    def walk(tokens):      # one verify step per text: tau is the mean of ``tokens``
        return {"tau": round(sum(tokens) / len(tokens), 4), "tokens": tokens, "steps": [1] * len(tokens)}
    low, high = walk([10, 11, 12, 13, 14]), walk([12, 13, 14, 15, 16])
    noisy = walk([16, 9, 14, 11, 12])       # above ``low`` by 0.4 on average, not on every text
    assert plateau([(5, low)], 1) is None                       # nothing to compare with yet
    assert plateau([(5, low), (10, high)], 1) is None           # +2 on every text: still rising
    flat = plateau([(5, low), (10, high), (15, high)], 1)
    assert flat == {"versions": [10, 15], "taus": [14.0, 14.0], "difference": 0.0, "ci95": [0.0, 0.0]}
    assert plateau([(5, low), (10, high), (15, high)], 2) is None   # 15 against 5: risen
    within = plateau([(5, low), (10, noisy)], 1)
    assert within["difference"] == 0.4 and within["ci95"][0] < 0 < within["ci95"][1]
    assert plateau_reason(flat).startswith("plateau: held-out walk tau 14.0000 at step 15 against 14.0000 at step 10")
    assert plateau([(5, low), (10, low)], 0) is None             # off


def test_evaluator_walk_is_the_walk_over_its_texts(setup, fitted):
    """The per-text walk on each eval line (what ``eval.plateau`` compares) is
    ``tau.walk_counts`` over the same held-out texts."""
    from dflash_actors.eval.evaluator import HeldOut, evaluate_version, heldout_path
    from dflash_actors.eval.tau import walk_counts
    cfg, target, _ = setup
    ds = open_dataset(cfg.data, progress=False, path=heldout_path(cfg))
    got = evaluate_version(fitted, target, HeldOut(cfg, target, 8, 0, 16))["walk"]
    tokens, steps = walk_counts(fitted, target, ds, limit=8)
    assert (got["tokens"], got["steps"]) == (tokens, steps) and got["tau"] == round(sum(tokens) / sum(steps), 4)


# -- fast evaluation: batched forwards and replays must change cost, not results ----------


@pytest.fixture(scope="module")
def fitted(setup):
    """A drafter fitted for a moment (``tests.support.fitting``): real tau about 2.5."""
    cfg, target, _ = setup
    torch.manual_seed(0)
    drafter = build_drafter(cfg, target)
    fit_briefly(drafter, target, heldout_prompts(cfg, 6))
    return drafter


def test_rows_forward_equals_each_row_alone(setup):
    """``extend_rows`` batches the matrix products of generations with caches of different
    lengths: every row's logits, features and cache must be bit for bit those of
    ``TargetModel.extend`` alone, verify step after verify step (with crops between)."""
    from transformers import DynamicCache

    from dflash_actors.eval.decode import extend_rows
    _, target, _ = setup
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=g) for n in (3, 11, 6, 17)]
    rows, alone, starts = [], [], []
    for p in prompts:
        rows.append(DynamicCache())
        alone.append(DynamicCache())
        target.extend(p, 0, rows[-1])
        target.extend(p, 0, alone[-1])
        starts.append(len(p))
    for step in range(3):
        block = torch.randint(0, target.vocab_size, (len(prompts), B), generator=g)
        logits, feats = extend_rows(target, block, starts, rows)
        for r in range(len(prompts)):
            want_logits, want_feats = target.extend(block[r], starts[r], alone[r])
            assert torch.equal(logits[r], want_logits) and torch.equal(feats[r], want_feats), (step, r)
            assert all(torch.equal(a.keys, b.keys) for a, b in zip(rows[r].layers, alone[r].layers))
            keep = 1 + (step + r) % B
            starts[r] += keep
            if keep < B:
                rows[r].crop(keep - B)
                alone[r].crop(keep - B)


@pytest.mark.parametrize("block", [B, 3])      # 3: verify blocks and heads too small to batch exactly
def test_batched_decoding_and_greedy_equal_one_prompt_at_a_time(setup, block):
    from dflash_actors.eval.decode import DrafterBlocks, greedy_rows, speculative_generate_rows
    cfg, target, drafter = setup
    if block != B:
        drafter = build_drafter(cfg.updated({"drafter.block_size": block}), target)
    prompts = [PROMPT, PROMPT[:3], torch.tensor([9, 200, 31, 7, 77, 3, 150, 12, 64, 5])]
    want = greedy_generate(target, PROMPT, 20)
    stop = (int(want[len(PROMPT) + 9]),)
    gens = speculative_generate_rows(DrafterBlocks(drafter, target, len(prompts)), target, prompts, 20, block, stop)
    for p, g in zip(prompts, gens):
        one = speculative_generate(drafter_proposer(drafter, target), target, p, 20, block, stop)
        assert torch.equal(g.ids, one.ids) and (g.lengths, g.starts) == (one.lengths, one.starts)
    assert len(gens[0].ids) < len(PROMPT) + 20         # the stop token was hit
    for p, text in zip(prompts, greedy_rows(target, prompts, 20)):
        assert torch.equal(text, greedy_cached(target, p, 20)[0])


def test_replay_walks_like_decoding():
    """Anchors at 3, 4, 7; the last step sees past ``max_new_tokens`` (counted in full),
    and a verified stop token ends decoding, even one that is only the next anchor."""
    from dflash_actors.eval.decode import replay
    text = torch.arange(20)
    correct = np.zeros((16, 3), bool)
    correct[1] = [True, True, False]            # anchor 4: two accepted
    correct[4, :] = True                        # anchor 7: all three
    g = replay(correct, text, 3, 6)
    assert (g.starts, g.lengths) == ([3, 4, 7], [1, 3, 4]) and torch.equal(g.ids, text[:9])
    g = replay(correct, text, 3, 6, stop_ids=(7,))
    assert (g.starts, g.lengths) == ([3, 4], [1, 3]) and torch.equal(g.ids, text[:8])
    g = replay(correct, text, 3, 6, stop_ids=(6,))
    assert (g.starts, g.lengths) == ([3, 4], [1, 3]) and torch.equal(g.ids, text[:7])
    with pytest.raises(ValueError, match="verifies"):
        replay(correct, text[:11], 3, 6)


def test_drafter_correct_stops_at_the_first_wrong_slot(setup, fitted):
    """The vocabulary head runs only while a block is still right; what it returns equals
    the whole head's verdict up to each block's first wrong slot."""
    from dflash_actors.eval.tau import drafter_correct
    from dflash_actors.models.blocks import anchor_candidates, block_hidden, block_labels
    cfg, target, _ = setup
    drafter = fitted
    prompt = heldout_prompts(cfg, 1)[0]
    ids = greedy_generate(target, prompt, 40)
    mask = np.r_[np.zeros(len(prompt)), np.ones(40)].astype(np.int8)
    correct, valid = drafter_correct(drafter, target, ids, mask)
    _, feats = target.logits_and_hidden(ids[None])
    anchors = torch.from_numpy(anchor_candidates(mask))
    hidden = block_hidden(drafter, target.embed_tokens, drafter.context(feats[0]), ids, anchors)
    labels, v = block_labels(ids, torch.from_numpy(mask), anchors, B)
    full = ((target.lm_head(hidden).argmax(-1) == labels) & v)[:, 1:].numpy()
    assert np.array_equal(valid, v[:, 1:].numpy())
    assert np.array_equal(correct, np.cumprod(full, axis=1).astype(bool))
    lead = np.cumprod(full, axis=1).sum(1)
    assert (lead >= 2).any() and (full.sum(1) > lead).any()     # long runs, and right slots after a miss


def old_parity(target, proposers, prompts, max_new_tokens, stop_ids):
    """The evaluation as it was: every proposer decodes every prompt for real, alone,
    checked against cached greedy decoding; the simulated half over that text."""
    from dflash_actors.eval.tau import completion_mask, decode_stats, drafter_correct, proposer_correct, text_metrics
    refs = [greedy_cached(target, p, max_new_tokens, stop_ids)[0] for p in prompts]
    out = {}
    for name, (drafter, propose) in proposers.items():
        gens, correct, valid = [], [], []
        for p, ref in zip(prompts, refs):
            gens.append(speculative_generate(propose or drafter_proposer(drafter, target), target, p,
                                             max_new_tokens, B, stop_ids))
            c, v = (proposer_correct(propose, ref, len(p), B) if propose else
                    drafter_correct(drafter, target, ref, completion_mask(len(ref), len(p))))
            correct.append(c)
            valid.append(v)
        out[name] = {"real": decode_stats(gens, [len(p) for p in prompts], max_new_tokens, B, refs),
                     "simulated": text_metrics(np.concatenate(correct), np.concatenate(valid))}
    return out


@pytest.mark.parametrize("stop", [(), (219,)])
def test_fast_evaluation_equals_the_old_path(setup, fitted, stop):
    """``parity_report`` decodes only the trained drafter for real (batched) and replays
    the rest on the target's text computed once: every figure must equal the old path's.
    Stop token 219 is in the tiny target's repeating greedy loops: most texts end early."""
    from dflash_actors.eval.decode import NgramProposer, repeat_proposer
    from dflash_actors.eval.parity import parity_report
    cfg, target, untrained = setup
    prompts = heldout_prompts(cfg, 8)         # 6 the fitted drafter saw, 2 it did not
    ngram = NgramProposer(open_dataset(cfg.data, progress=False, path=ensure_synthetic_dataset(cfg.data)[0]), B)
    proposers = {"trained": (fitted, None), "untrained": (untrained, None), "ngram": (None, ngram),
                 "repeat": (None, repeat_proposer(B))}
    old = old_parity(target, proposers, prompts, 24, stop)
    new = parity_report(target, prompts, {"trained": fitted, "untrained": untrained},
                        {"ngram": ngram, "repeat": repeat_proposer(B)}, 24, stop, log=lambda m: None)["results"]
    keys = ("tau", "tau_pooled", "tau_clipped", "per_position", "verify_steps", "generated_tokens",
            "tokens_per_target_call")
    for name in proposers:
        assert {k: new[name]["real"][k] for k in keys} == {k: old[name]["real"][k] for k in keys}, name
        assert new[name]["simulated"] == old[name]["simulated"], name
    assert new["trained"]["real"]["lossless_prompts"] == old["trained"]["real"]["lossless_prompts"] == len(prompts)
    assert new["trained"]["real"]["replayed_tau"] == new["trained"]["real"]["tau"]
    assert new["ngram"]["real"]["decoded"] == "replayed" and new["trained"]["real"]["decoded"] == "real"
    assert old["trained"]["real"]["tau"] > 1.5 and old["ngram"]["real"]["tau"] > 1.5     # long acceptances
    assert (old["trained"]["real"]["generated_tokens"] < 24 * len(prompts)) == bool(stop)


def test_evaluator_real_tau_is_what_decoding_gives(setup, fitted):
    """The periodic evaluator replays decoding on the target's text of its prompts,
    computed once; its figures must be those of decoding the prompts for real."""
    from dflash_actors.eval.evaluator import HeldOut, evaluate_version
    cfg, target, _ = setup
    heldout = HeldOut(cfg, target, 8, 4, 16)
    got = evaluate_version(fitted, target, heldout)["real"]
    want = real_tau(fitted, target, [ids[:first] for ids, first, _ in heldout.items[:4]], 16, check_lossless="none")
    assert got == {k: want[k] for k in got} and got["tau"] > 1.5
    assert "real" not in evaluate_version(fitted, target, HeldOut(cfg, target, 8, 0, 16))


def test_evaluator_releases_the_target_and_keeps_its_metrics(setup, fitted, monkeypatch):
    """After ``prepare`` the evaluator holds only the target's head: the model it loaded
    (every decoder layer with it) is freed, and a version's metrics equal those computed
    with the whole target."""
    import weakref

    from dflash_actors.eval import evaluator
    cfg, target, _ = setup
    cfg = cfg.updated({"eval.max_samples": 8, "eval.real_prompts": 4, "eval.max_new_tokens": 16})
    loaded, load = [], evaluator.load_target

    def load_target(*args, **kwargs):
        t = load(*args, **kwargs)
        loaded.extend(weakref.ref(m) for m in [t.model, *t.model.get_decoder().layers])
        return t

    monkeypatch.setattr(evaluator, "load_target", load_target)
    drafter, head, heldout = evaluator.prepare(cfg)
    assert len(loaded) > 1 and all(ref() is None for ref in loaded)
    assert {n for n, v in vars(head).items() if isinstance(v, torch.nn.Module)} == {"embed_tokens", "lm_head"}
    drafter.load_state_dict(fitted.state_dict())
    got = evaluator.evaluate_version(drafter, head, heldout)
    want = evaluator.evaluate_version(fitted, target, evaluator.HeldOut(cfg, target, 8, 4, 16))
    assert got == want and got["real"]["tau"] > 1.5


def test_a_proposers_walk_replays_real_decoding_with_it(setup, tmp_path):
    """The n-gram table's walk over the target's held-out texts (``proposer_walk_counts``,
    what the recipe tables divide by) is its real tau on those prompts, text by text."""
    from dflash_actors.eval.decode import NgramProposer
    from dflash_actors.eval.tau import decode_stats, proposer_walk_counts
    cfg, target, _ = setup
    train, held = ensure_synthetic_dataset(cfg.data)
    ngram = NgramProposer(open_dataset(cfg.data, progress=False, path=train), B)
    heldout = open_dataset(cfg.data, progress=False, path=held)
    regen = open_dataset(cfg.data, progress=False, path=regenerate(target, heldout, tmp_path / "regen", 16))
    sub = tmp_path / "sub"
    ids, masks = zip(*(regen.sample(i) for i in range(4)))
    write_token_dataset(sub, *flatten(list(ids)), flatten(list(masks))[1])
    tokens, steps = proposer_walk_counts(ngram, open_dataset(cfg.data, progress=False, path=sub), B)
    prompts = [torch.from_numpy(i[:int(np.argmax(m))]) for i, m in zip(ids, masks)]
    for p, text, t, s in zip(prompts, ids, tokens, steps):
        real = decode_stats([speculative_generate(ngram, target, p, 16, B)], [len(p)], 16, B,
                            [torch.from_numpy(text)])
        assert real["lossless"] and t / s == pytest.approx(real["tau_clipped"], abs=1e-9)
    assert sum(tokens) / sum(steps) > 1.0        # the table drafts something right: the check has teeth
