"""Toy actors over the generic runtime alone: the runtime's tests and restart benchmark.

A toy batch b is a pure function of b (``expected_batch``), so every consumer can check
that the slot it reads holds exactly batch b, end to end.

Contract (the same shape as the real actors, with synthetic payloads):
  loader    consumes nothing; produces batch b's tokens in a batch slot and its shape
            (rows, tokens) in the ledger.
  target    consumes a batch slot, checks it, produces a feature slot: the batch fields
            plus ``hidden`` (``expected_hidden``), or with ``model="qwen3-tiny"`` the
            hidden states of a tiny random Qwen3.
  sink      (the last stage) consumes a batch or feature slot, checks it, writes a
            checksum into ``spec.results[b]`` (idempotent, so a retry after a kill
            overwrites rather than double counts) and commits.
  waits for Work; unblocked by the supervisor; on restart re-attaches and does what
  it is sent next. ``work_s`` stretches each item (beating every 10 ms) so kills land
  mid-batch; ``fail_on_start`` raises in ``attach``; ``contradict_at`` makes the sink
  raise a ``ProtocolError`` (a bug) at that batch.

``python -m tests.support.toy --run-dir D --batches N`` (from the repository root) runs
a toy job and exits with the job's exit code, printing the one-line error on failure.
"""

from __future__ import annotations

import argparse
import enum
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from dflash_actors.runtime import forking
from dflash_actors.runtime.actor import Actor, Escalate
from dflash_actors.runtime.channels import FieldSpec, RingSpec
from dflash_actors.runtime.config import RuntimeConfig, build
from dflash_actors.runtime.dispatch import Stage
from dflash_actors.runtime.messages import ProtocolError, Work
from dflash_actors.runtime.supervisor import Supervisor

VOCAB = 32000


class S(enum.IntEnum):
    PLANNED = 0
    LOADED = 1
    FEATURED = 2
    COMMITTED = 3


def expected_batch(b: int, token_budget: int, max_rows: int) -> dict[str, np.ndarray]:
    """Batch b's fields (trimmed to its real extent), a pure function of b."""
    k = 1 + b % min(4, max_rows)
    per = token_budget // k
    lengths = [1 + (b * 7 + r * 13) % per for r in range(k)]
    n = sum(lengths)
    return {"tokens": (b * 7919 + np.arange(n, dtype=np.int64) * 31) % VOCAB,
            "positions": np.concatenate([np.arange(m, dtype=np.int64) for m in lengths]),
            "rows": np.arange(k, dtype=np.int64) + 100 * b}


def expected_hidden(tokens: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    return ((tokens[:, None] + torch.arange(width)) % 251).to(dtype)


def checksum(b: int, token_budget: int, max_rows: int) -> int:
    e = expected_batch(b, token_budget, max_rows)
    return int(e["tokens"].sum()) * 7 + int(e["rows"].sum())


def batch_fields(token_budget: int, max_rows: int) -> tuple[FieldSpec, ...]:
    return (FieldSpec("tokens", (token_budget,), "int64"), FieldSpec("positions", (token_budget,), "int64"),
            FieldSpec("rows", (max_rows,), "int64"))


@dataclass(frozen=True)
class ToySpec:
    token_budget: int
    max_rows: int
    work_s: float = 0.0
    fail_on_start: bool = False
    model: Optional[str] = None
    check_hidden: bool = True
    results: Optional[torch.Tensor] = None
    contradict_at: Optional[int] = None
    """The sink's batch at which it finds the ledger contradicted (a ``ProtocolError``)."""
    escalate_rank: Optional[int] = None
    """A gang's rank (above 0) that raises ``ToyEscalate`` in ``attach``."""
    start_s: float = 0.0
    """How long ``attach`` takes (the targets'), as a load would."""
    start_counts: bool = True
    """Whether that load says how far it is (``Actor.starting``) every 0.2 s, or stays silent."""


class ToyEscalate(Escalate):
    """An error no restart can fix, raised by a gang's follower (``escalate_rank``)."""


class _Toy(Actor):
    spec: ToySpec

    def attach(self) -> None:
        if self.spec.fail_on_start:
            raise RuntimeError(f"toy {self.ctx.actor_id} told to fail on start")
        steps = round(self.spec.start_s / 0.2)
        for i in range(steps):
            if self.spec.start_counts:
                self.starting("toy load", i, steps)
            time.sleep(0.2)

    def _spend(self) -> None:
        end = time.monotonic() + self.spec.work_s
        while time.monotonic() < end:
            time.sleep(min(0.01, max(0.0, end - time.monotonic())))
            self.beat()

    def _check_batch(self, slot: dict, b: int) -> int:
        """Checks the slot holds batch b; returns its token count."""
        rows, tokens = self.ledger.meta(b)
        exp = expected_batch(b, self.spec.token_budget, self.spec.max_rows)
        for name, want in exp.items():
            if not np.array_equal(slot[name].numpy()[:len(want)], want):
                raise ValueError(f"{self.ctx.actor_id}: slot field {name} does not hold batch {b}")
        if (rows, tokens) != (len(exp["rows"]), len(exp["tokens"])):
            raise ValueError(f"{self.ctx.actor_id}: ledger shape of batch {b} is {(rows, tokens)}")
        return tokens


class ToyLoader(_Toy):
    def work(self, w: Work) -> None:
        slot = self.out_ring.slot(w.out_slot)
        exp = expected_batch(w.batch_id, self.spec.token_budget, self.spec.max_rows)
        self._spend()
        for name, arr in exp.items():
            slot[name][:len(arr)] = torch.from_numpy(arr)
        self.ledger.set_meta(w.batch_id, (len(exp["rows"]), len(exp["tokens"])))


class ToyTarget(_Toy):
    def attach(self) -> None:
        super().attach()
        if self.ctx.rank and self.ctx.rank == self.spec.escalate_rank:
            time.sleep(0.3)     # rank 0 is Ready by then: the gang must still stop on this
            raise ToyEscalate(f"rank {self.ctx.rank} told to escalate")
        self.model = None
        if self.spec.model == "qwen3-tiny":
            from transformers import Qwen3Config, Qwen3ForCausalLM
            torch.manual_seed(0)
            cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=128, head_dim=16)
            self.model = Qwen3ForCausalLM(cfg).eval()

    def work(self, w: Work) -> None:
        src = self.in_ring.slot(w.in_slot)
        n = self._check_batch(src, w.batch_id)
        if self.ctx.rank > 0:       # a gang's follower (``target_gang``): checks and spends, writes nothing
            self._spend()
            return
        dst = self.out_ring.slot(w.out_slot)
        for name in ("tokens", "positions", "rows"):
            dst[name].copy_(src[name])
        hidden = dst["hidden"]
        if self.model is None:
            hidden[:n] = expected_hidden(src["tokens"][:n], hidden.shape[1], hidden.dtype)
        else:
            with torch.no_grad():
                out = self.model(input_ids=src["tokens"][None, :n], position_ids=src["positions"][None, :n],
                                 use_cache=False, output_hidden_states=True)
            hs = torch.cat([out.hidden_states[i][0] for i in (1, 2, 3)], dim=-1)
            hidden[:n, :hs.shape[1]] = hs.to(hidden.dtype)
        self._spend()


class ToySink(_Toy):
    def work(self, w: Work) -> None:
        src = self.in_ring.slot(w.in_slot)
        n = self._check_batch(src, w.batch_id)
        if w.batch_id == self.spec.contradict_at:
            raise ProtocolError(f"{self.ctx.actor_id}: batch {w.batch_id} contradicts the ledger (told to)")
        if "hidden" in src and self.spec.check_hidden:
            hidden = src["hidden"]
            if not torch.equal(hidden[:n], expected_hidden(src["tokens"][:n], hidden.shape[1], hidden.dtype)):
                raise ValueError(f"{self.ctx.actor_id}: features of batch {w.batch_id} are wrong")
        self._spend()
        rows = self.ledger.meta(w.batch_id)[0]
        self.spec.results[w.batch_id] = int(src["tokens"][:n].sum()) * 7 + int(src["rows"][:rows].sum())


def toy_job(runtime: RuntimeConfig, n_batches: int, stages: int = 3, token_budget: int = 256,
            max_rows: int = 8, width: int = 24, work_s: float = 0.0, fail_on_start: str | None = None,
            n_targets: int = 1, n_drafters: int = 1, model: str | None = None,
            contradict_at: int | None = None, target_gang: int = 1,
            escalate_rank: int | None = None, target_start_s: float = 0.0,
            target_start_counts: bool = True, group=None,
            own_server: bool = False) -> tuple[Supervisor, torch.Tensor]:
    """A supervisor over loader -> [target ->] drafter (the sink) with toy actors, and
    the shared results table the sink fills. ``stages`` is 2 (loader -> drafter over
    the batch ring) or 3 (with targets and a feature ring); ``target_gang``: processes
    per target actor (``Stage.gang``); ``group``: the supervisor's group factory (real
    processes when None). Under the fork server, the actors fork from the session's
    (``shared_server``) unless ``own_server``: then the supervisor starts its own."""
    if stages not in (2, 3):
        raise ValueError("stages is 2 or 3")
    results = torch.full((n_batches,), -1, dtype=torch.int64).share_memory_()
    base = ToySpec(token_budget, max_rows, work_s=work_s)

    def spec(role, **kw):
        return replace(base, fail_on_start=fail_on_start == role, **kw)

    fields = batch_fields(token_budget, max_rows)
    rings = [RingSpec("batch", runtime.batch_slots, fields)]
    plan = [Stage("loader", ToyLoader, S.PLANNED, S.LOADED, out_ring="batch", spec=spec("loader"))]
    sink = spec("drafter", results=results, check_hidden=model is None, contradict_at=contradict_at)
    route = (lambda b: b % n_drafters)   # noqa: E731 - the toy's own batch-to-sink rule
    if stages == 3:
        hidden = FieldSpec("hidden", (token_budget, width), "bfloat16" if model else "float32")
        rings.append(RingSpec("features", runtime.feature_slots, fields + (hidden,)))
        plan.append(Stage("target", ToyTarget, S.LOADED, S.FEATURED, count=n_targets, in_ring="batch",
                          out_ring="features", gang=target_gang,
                          spec=spec("target", model=model, escalate_rank=escalate_rank, start_s=target_start_s,
                                    start_counts=target_start_counts)))
        plan.append(Stage("drafter", ToySink, S.FEATURED, S.COMMITTED, count=n_drafters, in_ring="features",
                          route=route, spec=sink))
    else:
        plan.append(Stage("drafter", ToySink, S.LOADED, S.COMMITTED, count=n_drafters, in_ring="batch",
                          route=route, spec=sink))
    extra = {"group": group} if group is not None else {}
    if not own_server and group is None and forking.resolve(runtime.start_method) == "forkserver":
        from . import shared_server  # here: an actor importing this module needs none of it

        extra["forkserver"] = shared_server.get()
    return Supervisor(runtime, plan, rings, n_batches, meta_cols=2, **extra), results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--work-s", type=float, default=0.0)
    p.add_argument("--fail-on-start", default=None, help="role whose actors raise in attach")
    p.add_argument("--target-gang", type=int, default=1, help="processes per target actor (Stage.gang)")
    p.add_argument("--set", action="append", default=[], help="runtime.KEY=VALUE")
    a = p.parse_args(argv)
    raw = {"run_dir": a.run_dir}
    for text in a.set:
        key, _, value = text.partition("=")
        raw[key.removeprefix("runtime.")] = float(value) if "." in value else int(value)
    sup, _ = toy_job(build(RuntimeConfig, raw, "runtime."), a.batches, stages=a.stages, work_s=a.work_s,
                     fail_on_start=a.fail_on_start, target_gang=a.target_gang, own_server=True)
    result = sup.run()
    if result.exit_code:
        print(f"error: {result.reason}", file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
