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
from dflash_actors.eval.prepare import regenerate
from dflash_actors.eval.tau import completion_entropy, real_tau, simulated_tau, walk_tau
from dflash_actors.models.drafter import build_drafter, sdpa_dense

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
    g = speculative_generate(drafter_proposer(drafter, target), target, PROMPT, 24, B)
    assert torch.equal(g.ids, greedy_generate(target, PROMPT, 24))


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
