"""Run configuration: frozen dataclasses loaded from YAML.

A config is a tree of sections (``data``, ``batching``, ``target``, ``drafter``,
``train``, ``topology``, ``runtime``, ``eval``, ``monitor``). ``load_config`` merges, in
order, the dataclass defaults, a YAML file and overrides (``(key, value)`` pairs, or
``--set section.key=value`` text), then validates once.
Every error is a ``ConfigError`` whose one-line message starts with the key path, so a
user sees ``batching.token_budget: must be >= 1 (got 0)`` rather than a traceback.

Field constraints live next to the field (``metadata={"check": ...}``); rules that tie
two sections together live in ``Config.__post_init__``. The checking machinery and the
``runtime`` section belong to the generic runtime (``runtime.config``).

Every command line that trains (``launch.py``, ``launch.py reference``) takes its
options through ``add_config_args``, so all of them start from the same default file,
``configs/default.yaml``. ``Config.updated`` derives a config from another with some
keys changed, as data: how the launch applies what it computes (a chosen topology, an
adapted accumulation, injected faults) without parsing text again.

The sections live in two modules: ``sections`` (data, batching, target, topology,
simulate, runtime, eval, monitor) and ``learning`` (drafter, train); this module holds
the tree (``Config``, its cross-section rules), loading and dumping.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from ..console import first_line
from ..runtime.config import ConfigError, build
from .learning import DrafterConfig, TrainConfig
from .sections import (
    BatchingConfig,
    DataConfig,
    EvalConfig,
    JobRuntimeConfig,
    MonitorConfig,
    SimulateConfig,
    SyntheticDataConfig,
    TargetConfig,
    TinyTargetConfig,
    TopologyConfig,
)

__all__ = ["BatchingConfig", "Config", "ConfigError", "DEFAULT_CONFIG", "DataConfig", "DrafterConfig",
           "EvalConfig", "JobRuntimeConfig", "MonitorConfig", "SimulateConfig", "SyntheticDataConfig",
           "TargetConfig", "TinyTargetConfig", "TopologyConfig", "TrainConfig", "Withheld", "add_config_args",
           "build", "config_from_args", "config_from_dict", "dump_config", "load_config", "parse_gang_topology",
           "parse_override", "parse_topology"]
"""The sections are re-exported: ``from dflash_actors.config import TrainConfig``."""

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
"""The embedded default: a tiny synthetic target and dataset, on CPU."""



HEAD_ARCHS = {
    # arch: (whether its terms need the target's distribution, those terms, how to turn them off)
    "dspark": (lambda d: bool(d.dspark_distance_alpha or d.dspark_confidence_alpha),
               "distance and confidence terms", "drafter.dspark_distance_alpha and dspark_confidence_alpha to 0"),
    "xpress": (lambda d: bool(d.xpress_tv_alpha or (d.xpress_ce_alpha and d.xpress_ce_labels == "target")),
               "TV term and target-argmax CE", "drafter.xpress_tv_alpha 0 and xpress_ce_labels data"),
}
"""The drafter archs with heads over the vocabulary whose objective ties them to ``train``."""


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    runtime: JobRuntimeConfig = field(default_factory=JobRuntimeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)

    def __post_init__(self):
        if self.drafter.block_size > self.batching.token_budget:
            raise ConfigError(
                f"drafter.block_size: must be <= batching.token_budget={self.batching.token_budget} "
                f"(got {self.drafter.block_size})")
        if self.data.max_seq_len > self.batching.token_budget:
            raise ConfigError(
                f"data.max_seq_len: must be <= batching.token_budget={self.batching.token_budget}, "
                f"or the longest sample fits no batch (got {self.data.max_seq_len})")
        if self.drafter.arch == "dflash2" and self.train.head_vocab != "full":
            raise ConfigError(f"train.head_vocab: dflash2 needs full (its selector trains on the head's top-"
                              f"{self.drafter.selector_top_k} over every token, as serving picks them; "
                              f"got {self.train.head_vocab})")
        if self.drafter.arch in HEAD_ARCHS:
            self._check_head_arch()
        tokens = self.train.drafter_block_tokens
        if tokens is not None and tokens < self.drafter.block_size:
            raise ConfigError(f"train.drafter_block_tokens: must be >= drafter.block_size={self.drafter.block_size} "
                              f"(one block; got {tokens})")
        if self.drafter.block_size > self.data.max_seq_len:
            raise ConfigError(
                f"drafter.block_size: must be <= data.max_seq_len={self.data.max_seq_len} "
                f"(got {self.drafter.block_size})")
        window = self.drafter.sliding_window
        if window is not None and window >= self.data.max_seq_len:
            raise ConfigError(
                f"drafter.sliding_window: must be < data.max_seq_len={self.data.max_seq_len}, or it cuts no "
                f"context and is full attention (null); got {window}")
        if self.eval.plateau and self.topology.nodes > 1:
            # Node 0's evaluator would end node 0 alone; the others would see a lost node.
            raise ConfigError(f"eval.plateau: one machine only for now (topology.nodes={self.topology.nodes})")
        if self.topology.target_tp > 1:
            # Only a gang's rank 0 writes features: the cache does not know ranks yet.
            if self.target.feature_cache != "off":
                raise ConfigError(f"target.feature_cache: not available with topology.target_tp="
                                  f"{self.topology.target_tp} yet (a gang computes every batch); use off")
        per_step = self.train.grad_accum * self.topology.num_drafters
        if self.runtime.schedule == "lockstep":
            # A lock-step group holds a whole step's batches in each ring at once.
            for name in ("batch_slots", "feature_slots"):
                if getattr(self.runtime, name) < per_step:
                    raise ConfigError(f"runtime.{name}: lockstep holds a whole step at once, so it needs "
                                      f">= grad_accum * drafters = {per_step} (got {getattr(self.runtime, name)})")

    def _check_head_arch(self) -> None:
        """What a DSpark's or an XPress's objective (``models.dspark``, ``models.xpress``)
        takes from the other sections: the target's distribution (``train.loss: distill``)
        for the terms that learn it, the full head, and slots weighed by decay."""
        d, t = self.drafter, self.train
        arch = d.arch
        needs, why, off = HEAD_ARCHS[arch]
        if needs(d) and t.loss != "distill":
            raise ConfigError(f"train.loss: {arch}'s {why} learn the target's distribution, which only distill "
                              f"puts into the features (got {t.loss}; or set {off})")
        if t.head_vocab != "full":
            raise ConfigError(f"train.head_vocab: {arch} needs full (its head biases every token; got {t.head_vocab})")
        if t.position_weight != "decay":
            raise ConfigError(f"train.position_weight: {arch} weighs its slots by decay (got {t.position_weight})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def carrying(self, sections: tuple[str, ...], holder: str) -> "Config":
        """This config with only ``sections`` readable: every other section is a
        ``Withheld`` that names ``holder`` when something reads it. An actor's spec
        carries such a config, so its inputs are the sections it lists, and a stage that
        starts to read one more fails on its first read instead of depending on it
        silently. Not validated again (the whole config was)."""
        unknown = sorted(set(sections) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"{holder}: no config sections {unknown}")
        out = object.__new__(Config)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            object.__setattr__(out, f.name, value if f.name in sections else Withheld(f.name, holder))
        return out

    def updated(self, changes: dict[str, Any]) -> "Config":
        """This config with ``changes`` (dotted key -> value, as data) applied, validated
        again as a whole: how the launch derives a setting it computes (a chosen
        topology, an adapted accumulation, injected faults) without re-reading text."""
        raw = self.to_dict()
        for key, value in changes.items():
            _set_path(raw, key, value)
        return config_from_dict(raw)

    def digest(self, sections: tuple[str, ...] | None = None) -> str:
        """Stable hash of the whole config or of some sections (for caches, resume)."""
        d = self.to_dict()
        if sections is not None:
            d = {k: d[k] for k in sections}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


class Withheld:
    """A config section a holder does not carry (``Config.carrying``): reading any field of
    it raises, naming the holder and the section to add to what it carries."""

    def __init__(self, section: str, holder: str):
        self._section, self._holder = section, holder

    def __getattr__(self, name: str):
        if name.startswith("_"):    # copy, pickle and hasattr probe dunders; ours are set in __init__
            raise AttributeError(name)
        raise AttributeError(f"{self._holder} does not carry config section {self._section!r} "
                             f"(read {self._section}.{name}); add it to the sections it carries")

    def __reduce__(self):
        return Withheld, (self._section, self._holder)

    def __repr__(self) -> str:
        return f"Withheld({self._section!r}, {self._holder!r})"


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for i, k in enumerate(keys[:-1]):
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(keys[:i + 1])}: is a value, not a section (in --set {dotted})")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=c`` -> ("a.b", c) with c parsed as a YAML scalar or list."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text}: expected key.path=value")
    if not raw.strip():
        # Read as null it would quietly mean "the default": for data.path, synthetic data.
        raise ConfigError(f"{key.strip()}: empty value in --set {text} (write {key.strip()}=null for none)")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot parse value {raw!r} ({e.__class__.__name__})") from None
    return key.strip(), value


def parse_topology(text: str) -> tuple[int, int]:
    """``N-M`` -> (targets, drafters); ``NxK-M`` too (``parse_gang_topology`` keeps the K)."""
    n, _, m = parse_gang_topology(text)
    return n, m


def parse_gang_topology(text: str) -> tuple[int, int, int]:
    """``N-M`` or ``NxK-M`` -> (targets, devices per target, drafters): ``2x4-2`` is two
    targets of four tensor-parallel ranks each (``topology.target_tp``) and two drafters."""
    parts = text.split("-")
    gang = parts[0].split("x") if len(parts) == 2 else []
    if len(gang) not in (1, 2) or not all(p.isdigit() for p in (*gang, parts[-1])):
        raise ConfigError(f"topology: expected N-M such as 2-2, or NxK-M such as 2x4-2 for targets of K "
                          f"devices each (got {text!r})")
    n, k, m = int(gang[0]), int(gang[1]) if len(gang) == 2 else 1, int(parts[1])
    if n < 1 or m < 1:
        raise ConfigError(f"topology: needs at least one target and one drafter (got {text!r})")
    if k < 1:
        raise ConfigError(f"topology: a target spans at least one device (got {text!r})")
    return n, k, m


def config_from_dict(raw: dict | None) -> Config:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config: top level must be a mapping (got {type(raw).__name__})")
    return build(Config, raw)


def load_config(path: str | Path | None = None, overrides: Iterable[str | tuple[str, Any]] = (),
                topology: str | None = None) -> Config:
    """Defaults <- YAML file <- ``--topology`` <- overrides, validated once. An override
    is ``(dotted key, value)``, or ``--set`` text (``key=value``, parsed here)."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config: file not found: {p}")
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config: {p} is not UTF-8 text (byte {e.start}: {e.reason})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config: {p} is not valid YAML ({first_line(e)})") from None
        if raw is None:
            # An empty file is more likely a failed write or the wrong file than a wish
            # for the dataclass defaults (which are not configs/default.yaml); ``{}`` says that.
            raise ConfigError(f"config: {p} is empty (no settings; write {{}} for the built-in defaults)")
        if not isinstance(raw, dict):
            raise ConfigError(f"config: {p} must hold a mapping at top level")
    if topology is not None:
        n, k, m = parse_gang_topology(topology)
        _set_path(raw, "topology.num_targets", n)
        _set_path(raw, "topology.num_drafters", m)
        if "x" in topology:
            _set_path(raw, "topology.target_tp", k)
    for item in overrides:
        key, value = parse_override(item) if isinstance(item, str) else item
        _set_path(raw, key, value)
    return config_from_dict(raw)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(json.loads(json.dumps(cfg.to_dict())), sort_keys=False)


def add_config_args(ap: argparse.ArgumentParser) -> None:
    """``--config``, ``--topology`` and ``--set``, the same in every command."""
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    ap.add_argument("--topology", help="N-M: N target actors, M drafter actors (e.g. 2-2); NxK-M: each target "
                                       "a tensor-parallel gang of K devices (e.g. 2x4-2); launch.py also "
                                       "takes auto: measure the stages and split the devices")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set train.lr=3e-4 (repeatable)")


def config_from_args(args: argparse.Namespace) -> Config:
    """The config ``add_config_args`` describes (``launch.py`` adds the node and the run
    directory to the same, ``launch.config_of``)."""
    # None: --config not given (launch.py tells that apart from the default for --resume).
    return load_config(args.config or DEFAULT_CONFIG, args.overrides, topology=args.topology)
