"""``target.share_weights``: the target's tensors packed once into one shared buffer, a
target built on them that computes the same bits as one read from disk, zero copy on
CPU, tied weights kept tied, and a mismatch refused."""

import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_actors.config import ConfigError
from dflash_actors.models import shared_weights as sw
from dflash_actors.models.target import ensure_target, load_target


def test_a_target_on_shared_weights_computes_the_same_bits_in_place(tiny):
    cfg, target = tiny
    path = ensure_target(cfg)
    weights = sw.share_target(path, torch.float32)
    assert weights.flat.is_shared() and weights.nbytes >= sw.weight_bytes(path, torch.float32) > 0
    shared = load_target(cfg, weights=weights)
    ids = torch.randint(0, target.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    assert torch.equal(shared.hidden(ids), target.hidden(ids))
    # Every parameter and buffer (rotary frequencies too) is a view of the one buffer.
    lo, hi = weights.flat.data_ptr(), weights.flat.data_ptr() + weights.nbytes
    tensors = [*shared.model.parameters(), *shared.model.buffers()]
    assert tensors and all(lo <= t.data_ptr() < hi for t in tensors)
    # What an actor receives pickles whole (one buffer, whatever the tensor count).
    again = pickle.loads(ForkingPickler.dumps(weights))
    assert len(again.entries) == len(weights.entries) > 10


def test_tied_weights_stay_tied_and_a_foreign_model_is_refused(tmp_path):
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    tied = LlamaForCausalLM(config)
    # Tied by hand: whether transformers ties at construction varied in a long test
    # process; what is tested here is that a tie in the source survives the packing.
    tied.lm_head.weight = tied.model.embed_tokens.weight
    tied.save_pretrained(tmp_path / "tied")
    weights = sw.pack(tied)
    model = sw.build_on(tmp_path / "tied", weights, torch.device("cpu"), torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [e[0] for e in weights.entries]
    assert "lm_head.weight" in names and len({e[3] for e in weights.entries}) < len(names)
    LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 3})).save_pretrained(tmp_path / "deeper")
    with pytest.raises(ValueError, match="do not fit the model"):
        sw.build_on(tmp_path / "deeper", weights, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("setting, nbytes, available, shm, ranks, share, says", [
    ("auto", 2 * 10**9, 8 * 10**9, 8 * 10**9, 1, True, "2.00 GB read once into shared memory for 2 target(s)"),
    ("auto", 6 * 10**9, 8 * 10**9, 8 * 10**9, 1, False, "more than 50% of 8.00 GB of host memory available"),
    # A default container's /dev/shm: RAM to spare, yet the shared bytes would not fit.
    ("auto", 2 * 10**9, 64 * 10**9, 64 * 10**6, 1, False, "64.0 MB free in /dev/shm"),
    ("auto", 2 * 10**9, 8 * 10**9, 8 * 10**9, 4, True, "whose 4 ranks each slice their shard from it"),
    ("auto", 6 * 10**9, 8 * 10**9, 8 * 10**9, 4, False, "each of the 4 ranks of each target reads its shard"),
    ("on", 6 * 10**9, 8 * 10**9, 8 * 10**9, 1, True, "share_weights on"),
    ("off", 10**6, 8 * 10**9, 8 * 10**9, 1, False, "1.0 MB; each target reads them from disk"),
])
def test_auto_shares_what_fits_and_says_so_in_one_line(setting, nbytes, available, shm, ranks, share, says):
    got, line = sw.decide(setting, nbytes, 2, available, shm, ranks)
    assert got is share and says in line and "\n" not in line


def test_on_that_cannot_fit_in_dev_shm_is_refused_with_one_line():
    with pytest.raises(ConfigError, match=r"^target.share_weights: on needs 2.00 GB in /dev/shm, which has 64.0 MB"):
        sw.decide("on", 2 * 10**9, 1, 64 * 10**9, 64 * 10**6)


def test_dev_shm_is_where_shared_tensors_live():
    """The premise of counting /dev/shm: a shared tensor takes its bytes from it."""
    before = sw.shm_free()
    t = torch.empty(64 * 2**20, dtype=torch.uint8).share_memory_()
    t.fill_(1)
    assert before - sw.shm_free() >= 60 * 2**20
