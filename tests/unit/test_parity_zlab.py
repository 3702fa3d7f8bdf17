"""Our exported drafters run in z-lab's own code, imported unmodified from the pinned
``dflash`` wheel (``make peers``), and decode as ours do. Skipped only where that wheel
could not be fetched, with the reason.

A DFlash, a DFlash2 and a DFlash drafter with a sliding-window layer (window 8, next to a
full one; the prompts and the test's context are longer than the window), each fitted for
a moment to the tiny target's greedy text, are exported (``save_pretrained``) and loaded
by z-lab's ``DFlashDraftModel`` / ``DFlash2DraftModel.from_pretrained``. Their forward
gives our hidden states, and z-lab's ``dflash_generate`` (greedy, the target's HF model)
gives the tokens ours does, with the same accepted length at every verify step where
z-lab verifies a whole block.

Where the two counts part, by design: near ``max_new_tokens`` z-lab 0.1.0 verifies a
shorter block, counts only the tokens that fit and stops once ``max_new_tokens`` are
there; ``eval.decode`` counts the last step in full (as z-lab's repository did before
this release) and verifies once more when the last kept token is the anchor.
"""

import pytest
import torch

from benchmarks import peers
from dflash_actors.eval.decode import drafter_proposer, speculative_generate
from dflash_actors.models.blocks import make_attends
from dflash_actors.models.drafter import sdpa_dense
from dflash_actors.models.drafter_start import build_drafter
from dflash_actors.models.loss import Objective
from tests.support.fitting import fit_briefly, heldout_prompts

NEW = 40


@pytest.fixture(scope="module")
def zlab():
    try:
        return peers.load("dflash", ("dflash.model",)).modules["dflash.model"]
    except peers.PeerUnavailable as e:
        pytest.skip(str(e))


def dflash2(cfg):
    return cfg.updated({"drafter.arch": "dflash2", "drafter.selector_rank": 8, "drafter.selector_top_k": 6,
                        "train.selector_norm": "own"})


def sliding(cfg):
    return cfg.updated({"drafter.num_layers": 2, "drafter.sliding_window": 8,
                        "drafter.layer_types": ("sliding_attention", "full_attention")})


@pytest.fixture(scope="module", params=["dflash", "dflash2", "sliding"])
def drafters(request, tiny, zlab, tmp_path_factory):
    """(ours fitted, z-lab's class loaded from our export, target, prompts)."""
    cfg, target = tiny
    c = {"dflash": cfg, "dflash2": dflash2(cfg), "sliding": sliding(cfg)}[request.param]
    d = build_drafter(c, target)
    if request.param == "dflash2":         # the selector moved off its start, as training moves it
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in d.named_parameters():
                if "_conv." in name or name.startswith("candidate_selector."):
                    p.add_(torch.randn(p.shape, generator=g) * (0.3 if "kernel" in name or "codebook" in name
                                                                 else 0.05))
    prompts = heldout_prompts(cfg, 6)
    fit_briefly(d, target, prompts, selector=Objective.from_config(c).selector)
    out = tmp_path_factory.mktemp(request.param)
    d.save_pretrained(out)
    cls = zlab.DFlash2DraftModel if request.param == "dflash2" else zlab.DFlashDraftModel
    theirs = cls.from_pretrained(out).to(torch.float32).eval()
    assert type(theirs) is cls
    return d, theirs, target, prompts


def test_zlabs_class_loads_our_export_and_computes_our_hidden_states(drafters):
    d, theirs, _, _ = drafters
    # z-lab's DFlash2 keeps the codebooks as nn.Embedding (``.weight``) and maps the published names on load.
    zlab_names = {k: (k + ".weight" if k.endswith("_codebook") else k) for k in d.state_dict()}
    assert set(zlab_names.values()) == set(theirs.state_dict())
    assert all(torch.equal(v, theirs.state_dict()[zlab_names[k]]) for k, v in d.state_dict().items())
    g = torch.Generator().manual_seed(3)
    B, C, H = d.block_size, 21, d.config.hidden_size
    noise, feats = torch.randn(1, B, H, generator=g), torch.randn(1, C, d.fc.in_features, generator=g)
    pos = torch.arange(C + B)[None]
    with torch.no_grad():
        got = theirs(position_ids=pos, noise_embedding=noise, target_hidden=feats)
        # Decoding's path (cached context keys, each layer's window) ...
        cached = d.forward_cached(noise, d.context_kv(d.context(feats), pos[:, :C]), pos[:, C:])
        # ... and training's: the block anchored at C, under the blocks' own masks.
        trained = d(noise, d.context(feats), pos, make_attends(d, torch.tensor([[C]]), torch.tensor([C]), C, B))
    torch.testing.assert_close(cached, got, atol=1e-5, rtol=0)
    torch.testing.assert_close(trained, got, atol=1e-5, rtol=0)
    if d.windows != {None}:     # the window cuts here: full attention computes something else
        with torch.no_grad():
            full = d(noise, d.context(feats), pos, sdpa_dense(None))
        assert (full - got).abs().max() > 1e-3


def zlab_generate(zlab, theirs, target, prompt, monkeypatch):
    # return_stats times the steps with torch.cuda.synchronize, which a CPU-only torch refuses.
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return zlab.dflash_generate(theirs, target.model, prompt[None], NEW, None, temperature=0.0, return_stats=True)


def test_zlabs_decoding_gives_our_tokens_and_acceptances(zlab, drafters, monkeypatch):
    d, theirs, target, prompts = drafters
    B = d.block_size
    accepted = 0
    for prompt in prompts[:3]:
        ours = speculative_generate(drafter_proposer(d, target), target, prompt, NEW, B)
        out = zlab_generate(zlab, theirs, target, prompt, monkeypatch)
        assert torch.equal(out.output_ids[0], ours.ids)
        end = len(prompt) + NEW
        # z-lab verifies while start + 1 < end, a whole block while start + B <= end.
        steps = [s for s in ours.starts if s + 1 < end]
        full = sum(s + B <= end for s in steps)
        theirs_lengths = out.acceptance_lengths
        assert len(theirs_lengths) == len(steps)
        assert theirs_lengths[:full] == ours.lengths[:full]
        assert sum(theirs_lengths) == NEW - 1        # the prefill made the first token
        accepted += sum(ours.lengths[:full]) - full
    assert accepted > 0


def test_the_check_sees_a_drafter_that_proposes_otherwise(zlab, drafters, monkeypatch):
    d, theirs, target, prompts = drafters
    with torch.no_grad():
        theirs.layers[0].mlp.down_proj.weight.mul_(-1.0)
    try:
        lengths = [zlab_generate(zlab, theirs, target, p, monkeypatch).acceptance_lengths for p in prompts[:3]]
        want = [speculative_generate(drafter_proposer(d, target), target, p, NEW, d.block_size).lengths
                for p in prompts[:3]]
        assert any(t[:5] != w[:5] for t, w in zip(lengths, want))
    finally:
        with torch.no_grad():
            theirs.layers[0].mlp.down_proj.weight.mul_(-1.0)
