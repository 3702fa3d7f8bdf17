"""prepare's in-process engine: continuous batching against plain greedy decoding one
prompt at a time (the same text, no idle row), its sampling against transformers' own
warpers, and its determinism."""

import pytest
import torch

from dflash_actors.config import load_config
from dflash_actors.eval.decode import greedy_cached
from dflash_actors.models.target import ensure_target, load_target
from dflash_actors.prepare.generate import ContinuousBatch, SamplingSettings, sample_next, sampling_probs
from tests.support.pipeline import ROOT, SMALL


@pytest.fixture(scope="module")
def target(cache_dir):
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs/default.yaml", SMALL + [f"data.cache_dir={cache_dir}"])
    ensure_target(cfg)
    return load_target(cfg, "cpu")


def prompts(n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(i, torch.randint(3, 250, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist())
            for i in range(n)]


def test_continuous_batch_is_plain_greedy_with_no_idle_row(target):
    """11 prompts of 2..8 tokens through 4 rows: each response is what greedy decoding
    of that prompt alone gives, cut after its first stop token; rows that end take the
    next prompt at once and leave at the end, so no row ever computes for nothing."""
    ps, n = prompts(), 10
    alone = {i: greedy_cached(target, torch.tensor(p), n)[0][len(p):].tolist() for i, p in ps}
    # Stop at a token the texts use at several depths, so rows end at different steps.
    counts = torch.bincount(torch.tensor([t for r in alone.values() for t in r]), minlength=256)
    stop = int(counts.argmax())
    want = {i: r[:r.index(stop) + 1] if stop in r else r for i, r in alone.items()}
    assert len({len(r) for r in want.values()}) > 2
    batch = ContinuousBatch(target.model, 4, [stop], 0, SamplingSettings(max_new_tokens=n), torch.Generator())
    got = batch.run(ps)
    assert got == want
    assert batch.idle_row_steps == 0 and batch.row_steps == sum(len(r) - 1 for r in want.values())


def test_sampling_follows_transformers_warpers():
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)) * 3
    for t, k, p in ((0.7, 50, 1.0), (1.3, 0, 0.8), (0.5, 20, 0.6), (1.0, 0, 1.0)):
        hf = [TemperatureLogitsWarper(t)] + ([TopKLogitsWarper(k)] if k else []) + \
            ([TopPLogitsWarper(p)] if p < 1 else [])
        want = torch.softmax(LogitsProcessorList(hf)(None, logits.clone()), -1)
        got = sampling_probs(logits, SamplingSettings(temperature=t, top_k=k, top_p=p))
        torch.testing.assert_close(got / got.sum(-1, keepdim=True), want)


def test_sampled_batches_repeat_with_their_seed(target):
    s = SamplingSettings(temperature=0.9, top_p=0.9, max_new_tokens=8)

    def run(seed):
        return ContinuousBatch(target.model, 3, [5], 0, s, torch.Generator().manual_seed(seed)).run(prompts())
    assert run(3) == run(3) != run(4)
    assert sample_next(torch.tensor([[0.0, 5.0, 1.0]]), SamplingSettings(), None).tolist() == [1]
