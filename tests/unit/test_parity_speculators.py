"""vLLM's speculators reads our DFlash export with its own converter, imported unmodified
from the pinned ``speculators`` wheel (``make peers``). Skipped only where that wheel could
not be fetched, with the reason.

speculators 0.9.0 has ``DFlashDraftModel`` and ``DFlash2DraftModel`` classes but converts
only DFlash checkpoints (``speculators.convert.dflash``; there is no DFlash2 converter):
``DFlashConverter`` takes our exported directory and the target as its verifier, builds its
config from our ``config.json`` and loads our weights strictly (an unexpected key is an
error), then its own ``from_pretrained`` loads the result. Its import needs ``loguru`` and
``hs_connectors``, which this environment lacks and the converter uses only to log and in
training's data transfer: those two are stubbed while it imports.
"""

import json

import pytest
import torch

from benchmarks import peers
from dflash_actors.models.drafter_start import build_drafter

STUBS = ("loguru", "hs_connectors")
CONVERTER = "speculators.convert.dflash.converter"
MODELS = "speculators.models.dflash"


@pytest.fixture(scope="module")
def speculators():
    try:
        return peers.load("speculators", (CONVERTER, MODELS, "speculators.models.dflash2"), stubs=STUBS)
    except peers.PeerUnavailable as e:
        pytest.skip(str(e))


def test_speculators_converts_and_loads_our_dflash_export(speculators, tiny, tmp_path):
    assert speculators.record()["peer"] == "speculators " + peers.PINS["speculators"].version
    assert set(speculators.stubbed) <= set(STUBS)
    cfg, target = tiny
    d = build_drafter(cfg, target)
    d.save_pretrained(tmp_path / "ours")
    verifier = str(target.model.name_or_path)
    speculators.modules[CONVERTER].DFlashConverter().convert(tmp_path / "ours", tmp_path / "theirs",
                                                              base_model=verifier, validate=True)
    conf = json.loads((tmp_path / "theirs" / "config.json").read_text())
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())
    dc = ours["dflash_config"]
    assert conf["speculators_model_type"] == "dflash" and conf["block_size"] == d.block_size
    assert conf["mask_token_id"] == dc["mask_token_id"]
    # speculators counts layers from the embedding and keeps the target's last layer implicit.
    last = target.num_layers
    assert conf["aux_hidden_state_layer_ids"] == [i + 1 for i in dc["target_layer_ids"] if i + 1 != last]
    layer = conf["transformer_layer_config"]
    assert {k: layer[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                                  "vocab_size")} == {k: ours[k] for k in ("hidden_size", "num_hidden_layers",
                                                                          "num_attention_heads", "head_dim",
                                                                          "vocab_size")}
    model = speculators.modules[MODELS].DFlashDraftModel.from_pretrained(str(tmp_path / "theirs"))
    theirs = model.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in d.state_dict().items())
    # What speculators adds is the verifier's: its embedding and head, bit for bit.
    extra = set(theirs) - set(d.state_dict())
    assert extra == {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    assert torch.equal(theirs["embed_tokens.weight"], target.embed_tokens.weight)
    assert torch.equal(theirs["verifier_lm_head.weight"], target.lm_head.weight)


def test_speculators_refuses_an_export_with_a_foreign_key(speculators, tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    cfg, target = tiny
    build_drafter(cfg, target).save_pretrained(tmp_path / "ours")
    weights = tmp_path / "ours" / "model.safetensors"
    state = load_file(str(weights))
    state["layers.0.self_attn.gate.weight"] = torch.zeros(1)
    save_file(state, str(weights))
    with pytest.raises(ValueError, match="Unexpected keys"):
        speculators.modules[CONVERTER].DFlashConverter().convert(
            tmp_path / "ours", tmp_path / "theirs", base_model=str(target.model.name_or_path), validate=False)


def test_speculators_has_no_dflash2_converter(speculators):
    """What 0.9.0 has for DFlash2: a config and a model class, no converter that reads an
    export (so our DFlash2 export is checked against z-lab's and NeMo's code instead)."""
    import importlib.util

    dflash2 = speculators.modules["speculators.models.dflash2"]
    assert hasattr(dflash2, "DFlash2DraftModel") and hasattr(dflash2, "DFlash2SpeculatorConfig")
    assert importlib.util.find_spec("speculators.convert.dflash2") is None
