"""The memory plan's traces, each traced once per plan and kept on disk across plans.

A trace (``train.memtrace``) takes from a fraction of a second to tens of seconds at
real sizes, a plan asks for dozens, and a run is planned again at every resume, every
demo and each of a test suite's hundred jobs. So each result is kept in
``<data.cache_dir>/memtrace/<digest>.json``, keyed by all it depends on:

- the trace's name and arguments;
- the target's config (``to_json_string``);
- torch's and transformers' versions;
- the text of every project module a trace can import (``traced_modules``: the closure
  of ``memtrace``'s imports, read from their source, those inside functions included;
  ``tests/unit/test_tracecache.py`` runs every trace in a fresh interpreter and checks
  that it imported nothing else).

``RunTraces`` answers the planner's questions for one run's config (its step, forward,
optimizer, and the parameter counts, a gang rank's among them: ``memplan.TraceSource``). The planner
takes any ``TraceSource``, so its search is tested on made-up figures as well.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path

import torch

from ..models.drafter import SHAPE_KEYS, dflash2_fields, shape_fields
from ..models.dspark import dspark_fields
from ..models.target import resolve_dtype
from ..models.xpress import xpress_fields
from . import memtrace

PACKAGE = __name__.split(".")[0]
ROOT = Path(__file__).resolve().parents[1]
"""The package's directory: ``dflash_actors``."""
DIGEST_CHARS = 24
"""Hex digits of a cache file's name: 96 bits, no collision among a machine's traces."""


class TraceCache:
    """``memtrace``'s functions of one target's config, each result computed once per
    instance and kept under ``cache_dir`` (None: in memory only)."""

    def __init__(self, target_config, cache_dir: Path | None):
        self.target_config = target_config
        self.cache_dir = cache_dir
        self.done: dict[str, object] = {}

    def get(self, name: str, **kwargs):
        """``memtrace.<name>(target_config, **kwargs)``, from memory, the disk, or traced."""
        key = json.dumps([name, {k: str(v) for k, v in sorted(kwargs.items())}])
        if key in self.done:
            return self.done[key]
        digest = hashlib.sha256("\0".join((code_version(), self.target_config.to_json_string(), key))
                                .encode()).hexdigest()[:DIGEST_CHARS]
        path = None if self.cache_dir is None else self.cache_dir / f"{digest}.json"
        try:
            value = json.loads(path.read_text())
        except (AttributeError, OSError, ValueError):
            out = getattr(memtrace, name)(self.target_config, **kwargs)
            value = dataclasses.asdict(out) if isinstance(out, memtrace.StepTrace) else out
            if path is not None:
                _write(path, value)
        self.done[key] = memtrace.StepTrace(**value) if isinstance(value, dict) else value
        return self.done[key]


def _write(path: Path, value) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(value))
        tmp.replace(path)
    except OSError:
        pass        # a read-only cache: the plan is only traced again next time


class RunTraces:
    """The traces the memory plan of a run of ``cfg`` asks for (``memplan.TraceSource``),
    with ``memtrace``'s arguments taken from the config."""

    def __init__(self, cfg, target_config, layer_ids, cache: TraceCache | None = None):
        self.cfg = cfg
        self.layer_ids = list(layer_ids)
        self.features = len(self.layer_ids)
        self.cache = cache or TraceCache(target_config, Path(cfg.data.cache_dir) / "memtrace")
        fields = dflash2_fields(cfg.drafter)
        self.arch = {} if fields is None else {"dflash2": fields}     # a DFlash's keys as before
        if cfg.drafter.arch == "dspark":
            self.arch["dspark"] = dspark_fields(cfg.drafter)
        if cfg.drafter.arch == "xpress":
            self.arch["xpress"] = xpress_fields(cfg.drafter)
        # The drafter's own attention and MLP sizes; a window keeps what full attention keeps.
        shape = {k: v for k, v in shape_fields(cfg.drafter).items() if k in SHAPE_KEYS}
        if shape:
            self.arch["shape"] = shape

    def step(self, device_type: str, rows: int, ctx: int, anchors: int, ckpt: bool) -> memtrace.StepTrace:
        cfg = self.cfg
        cuda, compute = device_type == "cuda", cfg.train.compute_dtype
        return self.cache.get(
            "trace_drafter_step", layers=cfg.drafter.num_layers, block_size=cfg.drafter.block_size,
            feature_layers=self.features, head_dtype=resolve_dtype(cfg.target.dtype, torch.device(device_type)),
            autocast_bf16=(cuda and compute != "float32") or (not cuda and compute == "bfloat16"), cuda=cuda,
            rows=rows, ctx_len=ctx, anchors=anchors, checkpoint_layers=ckpt,
            head_loss="checkpointed" if cfg.train.head_loss == "checkpointed" else "fused", loss=cfg.train.loss,
            **self.arch)

    def forward(self, device_type: str, rows: int, length: int) -> memtrace.StepTrace:
        cfg = self.cfg
        return self.cache.get("trace_target_forward", dtype=resolve_dtype(cfg.target.dtype, torch.device(device_type)),
                              rows=rows, length=length, layer_ids=self.layer_ids, teacher=cfg.train.loss == "distill")

    def optimizer(self, device_type: str) -> memtrace.StepTrace:
        cfg = self.cfg
        return self.cache.get("trace_optimizer_step", layers=cfg.drafter.num_layers,
                              block_size=cfg.drafter.block_size, feature_layers=self.features,
                              drafters=cfg.topology.num_drafters, train=cfg.train, device=device_type, **self.arch)

    def target_numel(self) -> int:
        """The target's parameters (each counted once: tied embeddings too)."""
        return self.cache.get("target_numel")

    def target_rank_numel(self, ranks: int) -> int:
        """What each of a gang's ``ranks`` ranks holds of the target (``memtrace.target_rank_numel``)."""
        return self.cache.get("target_rank_numel", ranks=ranks)

    def drafter_numel(self) -> int:
        cfg = self.cfg
        return self.cache.get("drafter_numel", layers=cfg.drafter.num_layers, block_size=cfg.drafter.block_size,
                              feature_layers=self.features, **self.arch)


@functools.cache
def code_version() -> str:
    """What a trace's result depends on besides its arguments: the libraries' versions
    and the text of every project module it can import."""
    import transformers
    parts = [torch.__version__, transformers.__version__]
    for name in traced_modules():
        parts.append(hashlib.sha256(_source(name).read_bytes()).hexdigest())
    return ":".join(parts)


@functools.cache
def traced_modules() -> tuple[str, ...]:
    """The project's modules a trace can import: ``memtrace`` and, from its source on,
    every module any of them imports (at its top or inside a function), with the
    packages that hold them."""
    seen: set[str] = set()
    todo = [memtrace.__name__]
    while todo:
        name = todo.pop()
        if name in seen or _source(name) is None:
            continue
        seen.add(name)
        todo += _parents(name)
        todo += _imports(name)
    return tuple(sorted(seen))


def _source(name: str) -> Path | None:
    """The file of project module ``name``, or None (not the project's, or not a module)."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    path = ROOT.joinpath(*name.split(".")[1:])
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imports(name: str) -> list[str]:
    """The modules ``name``'s source imports, anywhere in it; for ``from X import y``
    both ``X`` and ``X.y`` (which is a module or, if not, skipped by ``_source``)."""
    path = _source(name)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out += [base, *(f"{base}.{a.name}" for a in node.names)]
    return out
