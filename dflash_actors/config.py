"""Run configuration: frozen dataclasses loaded from YAML.

A config is a tree of sections (``data``, ``batching``, ``target``, ``drafter``,
``train``, ``topology``, ``runtime``). ``load_config`` merges, in order, the dataclass
defaults, a YAML file, and ``--set section.key=value`` overrides, then validates once.
Every error is a ``ConfigError`` whose one-line message starts with the key path, so a
user sees ``batching.token_budget: must be >= 1 (got 0)`` rather than a traceback.

Field constraints live next to the field (``metadata={"check": ...}``); rules that tie
two sections together live in ``Config.__post_init__``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    """A bad config value; the message is one line that names the key path."""


# ---------------------------------------------------------------------------
# field constraints


def _ge(lo: float):
    def check(v):
        if v < lo:
            return f"must be >= {lo}"
    return check


def _in_range(lo: float, hi: float):
    def check(v):
        if not lo <= v <= hi:
            return f"must be in [{lo}, {hi}]"
    return check


def _gt(lo: float):
    def check(v):
        if not v > lo:
            return f"must be > {lo}"
    return check


def _opt(check):
    """Apply ``check`` only when the value is not None."""
    def wrapped(v):
        return None if v is None else check(v)
    return wrapped


def _f(default: Any, check=None):
    """A field with an optional constraint; mutable defaults are not used here."""
    return field(default=default, metadata={"check": check} if check else {})


# ---------------------------------------------------------------------------
# sections


@dataclass(frozen=True)
class SyntheticDataConfig:
    """The embedded default dataset: prompts then completions drawn from a sparse
    random order-2 Markov chain, so that the next token is learnable (a few likely
    successors per context) rather than uniform noise."""

    num_samples: int = _f(1024, _ge(1))
    heldout_samples: int = _f(32, _ge(0))
    vocab_size: int = _f(256, _ge(8))
    prompt_len: tuple[int, int] = (8, 32)
    completion_len: tuple[int, int] = (48, 160)
    branching: int = _f(3, _ge(1))
    seed: int = 1234

    def __post_init__(self):
        for name in ("prompt_len", "completion_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ConfigError(f"{name}: must be [min, max] with 1 <= min <= max (got {[lo, hi]})")


@dataclass(frozen=True)
class DataConfig:
    path: Optional[str] = None
    """HF ``save_to_disk`` directory, ``.arrow`` or ``.parquet``; None = synthetic."""
    max_seq_len: int = _f(4096, _ge(2))
    overlong: Literal["truncate", "drop"] = "truncate"
    cache_dir: str = ".cache"
    """Where the synthetic dataset and target are generated (keyed by their config)."""
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)


@dataclass(frozen=True)
class BatchingConfig:
    token_budget: int = _f(65536, _ge(1))
    """Padded tokens per batch: n_samples * longest_sample <= token_budget."""
    max_samples: int = _f(512, _ge(1))
    sort_pool: int = _f(64, _ge(1))
    """Length grouping sorts pools of about this many batches' worth of samples."""


@dataclass(frozen=True)
class TinyTargetConfig:
    """Shape of the synthetic Qwen3 target built from config (random init, then a short
    fit to the synthetic data so that its greedy text is not degenerate)."""

    hidden_size: int = _f(64, _ge(8))
    num_layers: int = _f(4, _ge(1))
    num_heads: int = _f(4, _ge(1))
    num_kv_heads: int = _f(2, _ge(1))
    intermediate_size: int = _f(128, _ge(1))
    pretrain_steps: int = _f(300, _ge(0))
    pretrain_batch: int = _f(8, _ge(1))
    """Sequences per pretraining step (the fit is kept short: seconds on one thread)."""

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"hidden_size: must be divisible by num_heads={self.num_heads} (got {self.hidden_size})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads: must be divisible by num_kv_heads={self.num_kv_heads} (got {self.num_heads})")


@dataclass(frozen=True)
class TargetConfig:
    path: Optional[str] = None
    """Local HF causal-LM directory (or GGUF package dir with ``gguf_file``); None = tiny."""
    gguf_file: Optional[str] = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: bfloat16 on CUDA, float32 on CPU."""
    tiny: TinyTargetConfig = field(default_factory=TinyTargetConfig)


@dataclass(frozen=True)
class DrafterConfig:
    num_layers: int = _f(1, _ge(1))
    block_size: int = _f(16, _ge(2))
    target_layer_ids: Optional[tuple[int, ...]] = None
    """Target layers whose outputs feed the drafter; None = build_target_layer_ids."""
    mask_token_id: Optional[int] = _f(None, _opt(_ge(0)))
    """An unused embedding row of the target; None = the target's last vocab row."""
    init_from: Optional[str] = None
    """A drafter directory (e.g. a released DFlash drafter) to start from; None = random init."""


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    epochs: int = _f(1, _ge(1))
    lr: float = _f(6e-4, _gt(0))
    warmup_ratio: float = _f(0.04, _in_range(0, 1))
    weight_decay: float = _f(0.0, _ge(0))
    grad_clip: float = _f(1.0, _gt(0))
    grad_accum: int = _f(1, _ge(1))
    num_anchors: int = _f(512, _ge(1))
    gamma: Optional[float] = _f(None, _opt(_gt(0)))
    """Loss decay over block slots; None = 7 for block 16, 5 for 10, 4 for 8."""
    checkpoint_every: int = _f(0, _ge(0))
    """Optimizer steps between checkpoints; 0 = only at the end and on signals."""
    num_threads: int = _f(1, _ge(1))
    """torch intra-op threads, the same in every actor and the reference (bit-identity)."""


@dataclass(frozen=True)
class TopologyConfig:
    num_targets: int = _f(1, _ge(1))
    num_drafters: int = _f(1, _ge(1))
    target_devices: Optional[tuple[str, ...]] = None
    """None = cuda:0..N-1 when enough GPUs exist, else cpu."""
    drafter_devices: Optional[tuple[str, ...]] = None
    """None = cuda:N..N+M-1 when enough GPUs exist, else cpu."""

    def __post_init__(self):
        for name, n in (("target_devices", self.num_targets), ("drafter_devices", self.num_drafters)):
            devs = getattr(self, name)
            if devs is not None and len(devs) != n:
                raise ConfigError(f"{name}: needs {n} entries to match the topology (got {list(devs)})")
            for d in devs or ():
                if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit()):
                    raise ConfigError(f"{name}: devices are 'cpu' or 'cuda:N' (got {d!r})")


@dataclass(frozen=True)
class RuntimeConfig:
    run_dir: str = "runs/latest"
    batch_slots: int = _f(4, _ge(1))
    feature_slots: int = _f(4, _ge(1))
    heartbeat_s: float = _f(0.5, _gt(0))
    hang_timeout_s: float = _f(60.0, _gt(0))
    max_restarts: int = _f(5, _ge(0))
    restart_window_s: float = _f(60.0, _gt(0))
    grace_s: float = _f(10.0, _ge(0))
    """How long actors get to finish on shutdown before SIGTERM, then SIGKILL."""
    start_timeout_s: float = _f(300.0, _gt(0))
    """Spawn to Ready (imports, model loading) before an actor counts as hung."""


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self):
        if self.drafter.block_size > self.batching.token_budget:
            raise ConfigError(
                f"drafter.block_size: must be <= batching.token_budget={self.batching.token_budget} "
                f"(got {self.drafter.block_size})")
        if self.data.max_seq_len > self.batching.token_budget:
            raise ConfigError(
                f"data.max_seq_len: must be <= batching.token_budget={self.batching.token_budget}, "
                f"or the longest sample fits no batch (got {self.data.max_seq_len})")
        if self.drafter.block_size > self.data.max_seq_len:
            raise ConfigError(
                f"drafter.block_size: must be <= data.max_seq_len={self.data.max_seq_len} "
                f"(got {self.drafter.block_size})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def digest(self, sections: tuple[str, ...] | None = None) -> str:
        """Stable hash of the whole config or of some sections (for caches, resume)."""
        d = self.to_dict()
        if sections is not None:
            d = {k: d[k] for k in sections}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------
# building from plain data, with type checks that name the key path


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], path)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: must be one of {list(args)} (got {value!r})")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: must be a mapping (got {value!r})")
        return _build(tp, value, path + ".")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: must be a list (got {value!r})")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{path}: must have {len(args)} entries (got {value!r})")
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 reads "1e-3" (no dot) as a string; accept what float() accepts.
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool):
        # bool is an int in Python; refuse it where a number is meant, and vice versa.
        if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
            raise ConfigError(f"{path}: must be {_type_name(tp)} (got {value!r})")
        return value
    raise TypeError(f"unsupported config type {tp!r} at {path}")


def _build(cls, raw: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in raw.items():
        path = prefix + name
        value = _coerce(value, hints[name], path)
        check = fields[name].metadata.get("check")
        problem = check(value) if check else None
        if problem:
            raise ConfigError(f"{path}: {problem} (got {value!r})")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # __post_init__ messages name the field within the section; add the section.
        raise ConfigError(f"{prefix}{e}") from None


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
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot parse value {raw!r} ({e.__class__.__name__})") from None
    return key.strip(), value


def parse_topology(text: str) -> tuple[int, int]:
    """``N-M`` -> (targets, drafters)."""
    parts = text.split("-")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"topology: expected N-M such as 2-2 (got {text!r})")
    n, m = int(parts[0]), int(parts[1])
    if n < 1 or m < 1:
        raise ConfigError(f"topology: needs at least one target and one drafter (got {text!r})")
    return n, m


def config_from_dict(raw: dict | None) -> Config:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config: top level must be a mapping (got {type(raw).__name__})")
    return _build(Config, raw)


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                topology: str | None = None) -> Config:
    """Defaults <- YAML file <- ``--topology`` <- ``--set`` overrides, validated once."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config: file not found: {p}")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config: {p} is not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config: {p} must hold a mapping at top level")
    if topology is not None:
        n, m = parse_topology(topology)
        _set_path(raw, "topology.num_targets", n)
        _set_path(raw, "topology.num_drafters", m)
    for text in overrides:
        key, value = parse_override(text)
        _set_path(raw, key, value)
    return config_from_dict(raw)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(json.loads(json.dumps(cfg.to_dict())), sort_keys=False)
