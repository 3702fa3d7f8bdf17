"""The target families users bring (issue 56's zoo), each a tiny random target with its
features on (``tests.support.zoo``): the hidden-state self-check on its padded batches,
with sequences longer than any sliding window; speculative decoding's cache rollback,
lossless; and the preflight's refusal of an unverified family without the self-check.
The launched runs (kill -9 and resume, ``evaluate``) are tests/integration/test_zoo_runs.py."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_actors.config import ConfigError, load_config
from dflash_actors.eval.decode import greedy_generate
from dflash_actors.job.preflight import check_family
from dflash_actors.models.drafter import DFlashDrafter, drafter_config
from dflash_actors.models.drafter_start import OFFSET_NORM_FAMILIES, init_from_target
from dflash_actors.models.self_check import self_check
from dflash_actors.models.target import TargetModel, load_target
from dflash_actors.models.target_dir import VERIFIED_FAMILIES, attention_for
from dflash_actors.prepare.generate import ContinuousBatch, SamplingSettings, batching_for, generate_batch
from tests.support.pipeline import ROOT
from tests.support.zoo import FAMILIES, build_model, family_config

LINEAR = [f for f in FAMILIES if "linear_attention" in (getattr(family_config(f), "layer_types", None) or ())]


@pytest.fixture(scope="module")
def models():
    """Each family's tiny target, built once for this module; one thread, as the
    other unit tests run (two threads of tiny matrices cost more than one here)."""
    torch.set_num_threads(1)
    return {}


def model(models, family):
    if family not in models:
        models[family] = build_model(family)
    return models[family]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_self_check_passes_on_every_family(models, family):
    self_check(TargetModel(model(models, family), [0, 2]), length=24)


def test_the_zoo_is_what_the_project_calls_verified():
    assert set(FAMILIES) == set(VERIFIED_FAMILIES)
    assert set(LINEAR) == {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}


@pytest.mark.parametrize("family", LINEAR)
def test_packing_two_sequences_in_one_row_would_leak_through_linear_attention(models, family):
    """Why the wrapper gives each sequence its own row: packed into one row with position
    ids that restart, full attention stays per sequence (transformers reads the restart),
    but a linear-attention layer carries its state from the first sequence into the
    second. The self-check's layout holds both apart, so a wrapper that packed rows would
    fail it."""
    target = TargetModel(model(models, family), [0, 2])
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, 100, (12,), generator=g), torch.randint(3, 100, (24,), generator=g)
    packed = torch.cat([a, b])[None]
    positions = torch.cat([torch.arange(12), torch.arange(24)])[None]
    out = target.model(input_ids=packed, position_ids=positions, use_cache=False, output_hidden_states=True)
    _, alone = target.logits_and_hidden(b[None], [0])
    leak = (out.hidden_states[1][0, 12:] - alone[0]).abs().max()
    assert leak > 1e-3 * alone.abs().max(), "linear attention no longer carries state across a packed row"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_verify_and_rollback_decode_the_targets_own_greedy_text(models, family):
    """Speculative decoding's target side on every family: ``new_cache`` holds the
    family's kinds of layers (recurrent state, sliding windows), ``keep_rollback`` lets a
    verify step's rejected drafts be cropped away, and the text is the target's own
    greedy continuation, past the window of 8."""
    target = TargetModel(model(models, family), [0, 2])
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 100, (7,), generator=g)
    want = greedy_generate(target, prompt, 24)
    cache = target.new_cache()
    logits, _ = target.extend(prompt, 0, cache)
    target.keep_rollback(cache, 4)
    ids, start = torch.cat([prompt, logits[-1].argmax()[None]]), len(prompt)
    while len(ids) < len(want):
        right = want[start + 1:start + 1 + int(torch.randint(0, 4, (1,), generator=g))]
        draft = torch.cat([right, torch.randint(3, 100, (3 - len(right),), generator=g)])
        logits, _ = target.extend(torch.cat([ids[start:start + 1], draft]), start, cache)
        posterior = logits.argmax(-1)
        accepted = int((draft == posterior[:-1]).long().cumprod(0).sum())
        ids = torch.cat([ids[:start + 1], draft[:accepted], posterior[accepted:accepted + 1]])
        start += accepted + 1
        cache.crop(-(cache.get_seq_length() - start))
    assert torch.equal(ids[:len(want)], want)


def test_a_family_without_sdpa_loads_with_eager_attention(tmp_path):
    # gpt-oss's sinks have no SDPA path: transformers refuses "sdpa" for it outright,
    # which load_target used to pass for every target.
    config = family_config("gpt_oss")
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert attention_for(config) == "eager" and attention_for(family_config("qwen3")) == "sdpa"
    build_model("gpt_oss").save_pretrained(tmp_path / "t")
    cfg = load_config(ROOT / "configs/default.yaml", [f"target.path={tmp_path / 't'}",
                                                      "drafter.target_layer_ids=[0, 2]"])
    target = load_target(cfg, "cpu")
    assert target.model.config._attn_implementation == "eager"
    self_check(target, length=24)


def test_an_unverified_family_without_the_self_check_is_refused():
    cfg = load_config(ROOT / "configs/default.yaml", ["target.self_check=false"])
    check_family(cfg, family_config("qwen3_next"))      # verified: the user's choice
    unknown = family_config("llama")
    unknown.model_type = "olmo3"
    with pytest.raises(ConfigError, match=r"^target\.self_check: off for a 'olmo3' target") as e:
        check_family(cfg, unknown)
    assert "\n" not in str(e.value)
    check_family(load_config(ROOT / "configs/default.yaml"), unknown)     # checked at start: fine


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_drafters_copied_norms_compute_the_targets(models, family):
    """``drafter.init: target`` copies norms as the family's own modules compute them: a
    zero weight is a zero output where a norm scales by ``w``, the input normalised where it
    scales by ``1 + w`` (``OFFSET_NORM_FAMILIES``, copied as ``1 + w``); and the copied final
    norm gives the target's final norm of the same input."""
    m = model(models, family)
    norm = m.model.norm
    x = torch.randn(3, m.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        zeroed = copy.deepcopy(norm)
        zeroed.weight.zero_()
        assert (zeroed(x).abs().max() > 0.1) == (family in OFFSET_NORM_FAMILIES)
        d = DFlashDrafter(drafter_config(m.config, 1, 4, [0], 127, "test", 128))
        state = {k: v + 0.1 * torch.randn(v.shape) if k.endswith("norm.weight") else v
                 for k, v in m.state_dict().items()}     # norms off their start, so that a wrong copy shows
        init_from_target(d, state.get, m.config.num_hidden_layers, ("norm",), family)
        norm.weight.copy_(state["model.norm.weight"])
        torch.testing.assert_close(d.norm(x), norm(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layers_are_copied_only_from_a_family_whose_layers_a_drafter_has(models, family):
    m = model(models, family)
    d = DFlashDrafter(drafter_config(m.config, 1, 4, [0], 127, "test", 128))
    state = m.state_dict()
    if family in ("llama", "qwen3"):
        init_from_target(d, state.get, m.config.num_hidden_layers, ("layers",), family)
        assert torch.equal(d.layers[0].mlp.down_proj.weight, state["model.layers.1.mlp.down_proj.weight"])
    else:
        with pytest.raises(ValueError, match=f"drafter.init_parts: layers: the {family}'s layer 1 .*drafter.init: "
                                             "random"):
            init_from_target(d, state.get, m.config.num_hidden_layers, ("layers",), family)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prepares_in_process_batching_regenerates_each_prompts_own_text(models, family):
    """``prepare``'s in-process engine, with the batching it picks for the family
    (``batching_for``: a linear-attention target cannot ride the continuous batch's cache),
    gives each prompt the greedy text the target gives it alone."""
    m = model(models, family).eval()
    settings = SamplingSettings(max_new_tokens=10)
    prompts = [[5 + i % 7 for i in range(n)] for n in (9, 14, 20, 11)]
    alone = [generate_batch(m, [p], settings, [], 0, 0)[0] for p in prompts]
    if batching_for(m, "continuous") == "continuous":
        out = ContinuousBatch(m, 2, [], 0, settings, torch.Generator().manual_seed(0)).run(list(enumerate(prompts)))
        assert [out[i] for i in range(len(prompts))] == alone
    else:
        assert family in LINEAR
        assert generate_batch(m, prompts, settings, [], 0, 0) == alone
