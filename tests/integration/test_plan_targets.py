"""The memory plan at full size for each published target (``benchmarks.plan_targets``):
every fixture names where its facts came from and builds in transformers' own config
class, and what the committed plans decided (``benchmarks/results/plans``) still holds
when a few of them are planned again, from a directory holding only a ``config.json``.
The rest of the sweep re-plans as a slow test (``pytest -m slow``)."""

import json

import pytest

from benchmarks import plan_targets as PT

FIXTURES = PT.fixtures()
CHEAP = ["qwen3-8b", "qwen3-coder-30b-a3b", "kimi-k2.5"]
"""Re-planned in every run: a dense target, an MoE one, and the MLA + MoE one whose
2-2 plan does not fit and whose 1x4-4 the split plan refuses (its traces are small)."""
NEED_TOLERANCE = 0.02
"""A GPU's planned need may move this much (relative) before a committed plan is stale:
the traces' figures, not the decisions, follow small changes of the code they run."""


def committed(name: str) -> dict:
    return json.loads((PT.PLANS / f"{name}.json").read_text())


@pytest.mark.parametrize("name", list(FIXTURES))
def test_each_fixture_names_its_source_and_has_a_plan(name):
    f = FIXTURES[name]
    assert f["name"] == name and "/" in f["hf_repo"] and f["file"].startswith("config.json")
    assert len(f["source"]) > 40 and isinstance(f["not_found"], dict)
    config = PT.target_config(f)
    assert config.model_type == f["config"]["model_type"] and int(config.num_hidden_layers) > 0
    kept = committed(name)
    assert kept["hf_repo"] == f["hf_repo"] and set(kept["plans"]) == set(PT.PLACEMENTS)


def check_plan(name: str, placement: str, tmp_path, cache_dir):
    want = committed(name)["plans"][placement]
    target = PT.write_target(FIXTURES[name], tmp_path / "target")
    code, line, error = PT.plan(target, placement, committed(name)["gpu_gib"], tmp_path / "run",
                                sets=(f"data.cache_dir={cache_dir}",))
    got = PT.decided(code, line, error)
    for key in ("exit", "fits", "refusal", "drafter_block_tokens", "checkpoint_layers", "optimizer_device",
                "feature_device", "eval_device"):
        assert got.get(key) == want.get(key), (name, placement, key, got.get(key), want.get(key))
    assert [g["device"] for g in got.get("gpus", [])] == [g["device"] for g in want.get("gpus", [])]
    for g, w in zip(got.get("gpus", []), want.get("gpus", [])):
        assert g["fits"] == w["fits"] and g["need_gib"] == pytest.approx(w["need_gib"], rel=NEED_TOLERANCE), (name, g)
    return got


@pytest.mark.parametrize("placement", PT.PLACEMENTS)
@pytest.mark.parametrize("name", CHEAP)
def test_the_committed_plans_still_hold(name, placement, tmp_path, cache_dir):
    got = check_plan(name, placement, tmp_path, cache_dir)
    if placement == "1x4-4" and FIXTURES[name]["config"]["model_type"] != "qwen3":
        # An MoE family: transformers' split plan keeps the experts whole, and the gang is refused by name.
        assert got["exit"] == 2 and "MoE experts" in got["refusal"] and "target_tp 1" in got["refusal"]
        assert FIXTURES[name]["config"]["model_type"] in got["refusal"]


@pytest.mark.slow
@pytest.mark.parametrize("placement", PT.PLACEMENTS)
@pytest.mark.parametrize("name", [n for n in FIXTURES if n not in CHEAP])
def test_the_rest_of_the_committed_plans_still_hold(name, placement, tmp_path, cache_dir):
    check_plan(name, placement, tmp_path, cache_dir)


TEMPLATE_GIBS = {"8x80": 80, "8x141": 141}


@pytest.mark.parametrize("gpus", list(TEMPLATE_GIBS))
@pytest.mark.parametrize("template", [pytest.param(t, marks=() if "qwen3-8b" in t or "27b" in t else pytest.mark.slow)
                                      for t in PT.TEMPLATES])
def test_each_templates_committed_plan_on_eight_gpus_still_holds(template, gpus, tmp_path, cache_dir):
    """The GPU templates as committed (``plan_targets --templates``): the two that users
    start from most are planned again in every run, the MoE and gpt-oss ones in the slow tier."""
    name, placement = PT.TEMPLATES[template]
    want = json.loads((PT.PLANS / f"template-{template.split('/')[-1].removesuffix('.yaml')}.json").read_text())
    want = want["plans"][gpus]
    code, line, error = PT.plan(PT.write_target(FIXTURES[name], tmp_path / "target"), placement, TEMPLATE_GIBS[gpus],
                                tmp_path / "run", template=template, sets=(f"data.cache_dir={cache_dir}",))
    got = PT.decided(code, line, error)
    assert got["exit"] == 0 and got["fits"], got.get("refusal")
    for key in ("drafter_block_tokens", "checkpoint_layers", "optimizer_device", "eval_device"):
        assert got[key] == want[key], (template, gpus, key)
