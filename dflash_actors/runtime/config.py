"""Validated frozen-dataclass configs, and the runtime's own section.

``build(cls, raw)`` turns plain data (from YAML or ``--set``) into a frozen dataclass,
checking types and per-field constraints (``metadata={"check": ...}``, made with
``checked``). Every error is a ``ConfigError`` whose one-line message starts with the
key path, e.g. ``runtime.grace_s: must be >= 0 (got -1)``. The project's full config
(``dflash_actors.config``) is built with the same machinery; the runtime itself knows
only ``RuntimeConfig``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional


class ConfigError(ValueError):
    """A bad config value; the message is one line that names the key path."""


# ---------------------------------------------------------------------------
# field constraints: each returns a problem string, or None when the value is fine


def at_least(lo: float):
    def check(v):
        if v < lo:
            return f"must be >= {lo}"
    return check


def in_range(lo: float, hi: float):
    def check(v):
        if not lo <= v <= hi:
            return f"must be in [{lo}, {hi}]"
    return check


def above(lo: float):
    def check(v):
        if not v > lo:
            return f"must be > {lo}"
    return check


def nonempty(v):
    # An empty path is Path("") == ".": the current directory, never what was meant.
    if not v.strip():
        return "must not be empty"


def optional(check):
    """Apply ``check`` only when the value is not None."""
    def wrapped(v):
        return None if v is None else check(v)
    return wrapped


def checked(default: Any, check=None):
    """A field with an optional constraint; mutable defaults are not used here."""
    return field(default=default, metadata={"check": check} if check else {})


# ---------------------------------------------------------------------------
# the runtime's section

FAULT_KINDS = ("sigkill", "exit", "exception", "hang", "slow", "segfault", "nan")


@dataclass(frozen=True)
class FaultConfig:
    """One injected fault (``runtime.faults``): when actor ``actor`` first reaches fault
    point ``at`` with a batch id >= ``at_batch``, it fails the way ``kind`` says, once
    per supervisor (a replacement does not fail again; a resumed job, which reuses the
    config, meets it again if it lies ahead). Points every actor has: ``work``
    (before the work) and ``commit`` (after the work, before its ledger commit); an actor
    may name more (the training job's optimizer: ``publish``, ``checkpoint``). Kinds:
    ``sigkill``, ``exit`` (status 3, no report), ``exception``, ``hang`` (no heartbeat
    until killed), ``slow`` (the work takes 10x as long, beating), ``segfault``, and
    ``nan`` (the actor makes its output non-finite, where it has a numeric output).
    ``actor: supervisor`` strikes the supervisor's own process with ``sigkill`` at a point
    of its own (``runtime.faults.SUPERVISOR_POINTS``; the training job's: ``gang``,
    ``share_weights``) once ``at_batch`` batches are committed, once per run directory:
    the job is then resumed, as after any kill of its supervisor."""

    actor: str
    at_batch: int = checked(0, at_least(0))
    kind: Literal[FAULT_KINDS] = "sigkill"
    at: str = "work"


@dataclass(frozen=True)
class RuntimeConfig:
    run_dir: str = checked("runs/latest", nonempty)
    batch_slots: int = checked(4, at_least(1))
    feature_slots: int = checked(4, at_least(1))
    heartbeat_s: float = checked(0.5, above(0))
    hang_timeout_s: float = checked(60.0, above(0))
    max_restarts: int = checked(5, at_least(0))
    restart_window_s: float = checked(60.0, above(0))
    grace_s: float = checked(10.0, at_least(0))
    """How long actors get to finish on shutdown before SIGTERM, then SIGKILL."""
    start_timeout_s: float = checked(300.0, above(0))
    """Spawn to Ready (imports, model loading) before an actor counts as hung."""
    fork_timeout_s: float = checked(10.0, above(0))
    """How long the fork server may take to fork an actor once its own imports are done
    (a fork takes milliseconds). Past it, or when it dies, the server counts as lost:
    it is killed and replaced, its actors with it (``runtime.supervisor``)."""
    start_method: Literal["auto", "forkserver", "spawn"] = "auto"
    """How actor processes start. ``forkserver``: forked from one server process that
    has already imported torch, transformers and the actor modules (``forker``), so a
    start or restart costs a fork; the server never touches CUDA, and every actor still
    sets its own threads and device. ``spawn``: a fresh interpreter per actor, which
    imports everything itself (seconds each). auto = forkserver where the platform
    has it (Linux), else spawn. ``launch.py`` starts the server as soon as the config
    is read, so that its imports overlap the launching process's own and the checks."""
    stuck_after_s: Optional[float] = checked(None, optional(above(0)))
    """A ready actor whose heartbeat is older than this shows as stuck in
    ``status.json`` (it is killed only at ``hang_timeout_s``); None: a quarter of that."""
    collective_timeout_s: float = checked(120.0, above(0))
    """Across machines (``cluster``): a node whose supervisor has not been heard from
    for this long, or a collective that has not completed in it, is lost; the others
    stop (exit 1) naming it. Slow actors never trip it: nodes meet in the store first
    and enter a collective only once all are ready."""
    collective_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``auto``: NCCL when the drafters are on CUDA devices, else gloo."""
    replica_check_every: int = checked(50, at_least(0))
    """Across machines: every this many steps the nodes compare a hash of their weights
    and AdamW moments and stop if any differs (0: only at the end)."""
    trace: bool = False
    """Write ``<run_dir>/trace.json``: every actor's spans, for Perfetto (``trace``)."""
    trace_batches: int = checked(100, at_least(1))
    """The trace keeps the spans of the first and the last this many batches."""
    faults: tuple[FaultConfig, ...] = ()
    """Faults to inject (``FaultConfig``); for testing recovery, e.g. ``make chaos``."""

    @property
    def stuck_s(self) -> float:
        return self.stuck_after_s if self.stuck_after_s is not None else self.hang_timeout_s / 4


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
        if isinstance(value, bool) and {"on", "off"} & set(args):
            # YAML reads a bare off / on (also no / yes) as a boolean: the word was meant.
            value = "on" if value else "off"
        if value not in args:
            raise ConfigError(f"{path}: must be one of {list(args)} (got {value!r})")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: must be a mapping (got {value!r})")
        return build(tp, value, path + ".")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: must be a list (got {value!r})")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{path}: must have {len(args)} entries (got {value!r})")
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is float:
        return _finite(_float(value, path), path)
    if tp in (int, float, str, bool):
        # bool is an int in Python; refuse it where a number is meant, and vice versa.
        if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
            raise ConfigError(f"{path}: must be {_type_name(tp)} (got {value!r})")
        return value
    raise TypeError(f"unsupported config type {tp!r} at {path}")


def _float(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{path}: must be float (got {value!r})")
    try:
        # YAML 1.1 reads "1e-3" (no dot) as a string; accept what float() accepts.
        return float(value)
    except ValueError:
        raise ConfigError(f"{path}: must be float (got {value!r})") from None


def _finite(value: float, path: str) -> float:
    # NaN passes every comparison check (nan < 0 is False) and inf passes most; neither
    # is a usable rate, timeout or cost.
    if not math.isfinite(value):
        raise ConfigError(f"{path}: must be a finite number (got {value!r})")
    return value


def build(cls, raw: dict, prefix: str = ""):
    """``cls(**raw)``, checked: unknown keys, types and field constraints are
    ``ConfigError``s naming ``prefix + key``."""
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
