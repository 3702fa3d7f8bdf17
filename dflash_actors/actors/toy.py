"""Toy actors for testing and benchmarking the runtime without the real models.

Contract (the same shape as the real actors, with synthetic payloads):
  loader    consumes nothing; produces batch b's packed tokens (``expected_batch(b)``,
            a pure function of b) in a batch slot and the shape in the ledger.
  target    consumes a batch slot, checks it is exactly batch b's, produces a feature
            slot: the batch fields plus ``hidden`` (``expected_hidden``), or with
            ``model="qwen3-tiny"`` the hidden states of a tiny random Qwen3.
  drafter   (the sink) consumes a batch or feature slot, checks it, writes a checksum
            into ``ctx.shared["results"][b]`` (idempotent, so a retry after a kill
            overwrites rather than double counts) and commits.
  waits for Work; unblocked by the supervisor; on restart re-attaches and does what
  it is sent next. ``work_s`` stretches each item (beating every 10 ms) so kills land
  mid-batch; ``fail_on_start`` raises in ``attach``.

``python -m dflash_actors.actors.toy --run-dir D --batches N`` runs a toy job and exits
with the job's exit code, printing the one-line error on failure.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from ..batching import BatchMeta
from ..channels import RingSpec
from ..config import RuntimeConfig, config_from_dict, parse_override
from ..dispatch import Stage
from ..ledger import State
from ..messages import Work
from ..supervisor import Supervisor
from .base import Actor

VOCAB = 32000


def expected_batch(b: int, token_budget: int, max_samples: int) -> dict[str, np.ndarray]:
    """Batch b's packed fields (trimmed to its real extent), a pure function of b."""
    k = 1 + b % min(4, max_samples)
    per = token_budget // k
    lengths = [1 + (b * 7 + r * 13) % per for r in range(k)]
    n = sum(lengths)
    input_ids = (b * 7919 + np.arange(n, dtype=np.int64) * 31) % VOCAB
    return {
        "input_ids": input_ids,
        "position_ids": np.concatenate([np.arange(m, dtype=np.int64) for m in lengths]),
        "loss_mask": (input_ids % 3 != 0).astype(np.int8),
        "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        "sample_ids": np.arange(k, dtype=np.int64) + 100 * b,
    }


def expected_hidden(input_ids: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    return ((input_ids[:, None] + torch.arange(width)) % 251).to(dtype)


def checksum(b: int, token_budget: int, max_samples: int) -> int:
    e = expected_batch(b, token_budget, max_samples)
    return int(e["input_ids"].sum()) * 7 + int(e["sample_ids"].sum())


class _Toy(Actor):
    def attach(self) -> None:
        if self.ctx.args.get("fail_on_start"):
            raise RuntimeError(f"toy {self.ctx.actor_id} told to fail on start")
        self.work_s = float(self.ctx.args.get("work_s", 0.0))

    def _spend(self) -> None:
        end = time.monotonic() + self.work_s
        while time.monotonic() < end:
            time.sleep(min(0.01, max(0.0, end - time.monotonic())))
            self.beat()

    def _check_batch(self, slot: dict, b: int) -> BatchMeta:
        meta = self.ledger.meta(b)
        ring = self.in_ring.spec
        exp = expected_batch(b, ring.fields[0].shape[0], ring.fields[3].shape[0] - 1)
        for name, want in exp.items():
            got = slot[name].numpy()[:len(want)]
            if not np.array_equal(got, want):
                raise ValueError(f"{self.ctx.actor_id}: slot field {name} does not hold batch {b}")
        if meta.n_tokens != len(exp["input_ids"]) or meta.n_samples != len(exp["sample_ids"]):
            raise ValueError(f"{self.ctx.actor_id}: ledger shape of batch {b} is {meta}")
        return meta


class ToyLoader(_Toy):
    def work(self, w: Work) -> None:
        slot = self.out_ring.slot(w.out_slot)
        spec = self.out_ring.spec
        exp = expected_batch(w.batch_id, spec.fields[0].shape[0], spec.fields[3].shape[0] - 1)
        self._spend()
        for name, arr in exp.items():
            slot[name][:len(arr)] = torch.from_numpy(arr)
        lengths = np.diff(exp["cu_seqlens"])
        self.ledger.set_meta(w.batch_id, BatchMeta(len(lengths), int(lengths.sum()), int(lengths.max())))


class ToyTarget(_Toy):
    def attach(self) -> None:
        super().attach()
        self.model = None
        if self.ctx.args.get("model") == "qwen3-tiny":
            from transformers import Qwen3Config, Qwen3ForCausalLM
            torch.manual_seed(0)
            cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=128, head_dim=16)
            self.model = Qwen3ForCausalLM(cfg).eval()

    def work(self, w: Work) -> None:
        src = self.in_ring.slot(w.in_slot)
        meta = self._check_batch(src, w.batch_id)
        dst = self.out_ring.slot(w.out_slot)
        for name in ("input_ids", "position_ids", "loss_mask", "cu_seqlens", "sample_ids"):
            dst[name].copy_(src[name])
        n, hidden = meta.n_tokens, dst["hidden"]
        if self.model is None:
            hidden[:n] = expected_hidden(src["input_ids"][:n], hidden.shape[1], hidden.dtype)
        else:
            with torch.no_grad():
                out = self.model(input_ids=src["input_ids"][None, :n], position_ids=src["position_ids"][None, :n],
                                 use_cache=False, output_hidden_states=True)
            hs = torch.cat([out.hidden_states[i][0] for i in (1, 2, 3)], dim=-1)
            hidden[:n, :hs.shape[1]] = hs.to(hidden.dtype)
        self._spend()


class ToySink(_Toy):
    def work(self, w: Work) -> None:
        src = self.in_ring.slot(w.in_slot)
        meta = self._check_batch(src, w.batch_id)
        if "hidden" in src and self.ctx.args.get("check_hidden", True):
            n, hidden = meta.n_tokens, src["hidden"]
            if not torch.equal(hidden[:n], expected_hidden(src["input_ids"][:n], hidden.shape[1], hidden.dtype)):
                raise ValueError(f"{self.ctx.actor_id}: features of batch {w.batch_id} are wrong")
        self._spend()
        ids = src["input_ids"][:meta.n_tokens]
        self.ctx.shared["results"][w.batch_id] = int(ids.sum()) * 7 + int(src["sample_ids"][:meta.n_samples].sum())


def toy_job(runtime: RuntimeConfig, n_batches: int, stages: int = 3, token_budget: int = 256,
            max_samples: int = 8, width: int = 24, work_s: float = 0.0,
            fail_on_start: str | None = None, n_targets: int = 1, n_drafters: int = 1,
            model: str | None = None, on_stop=None) -> Supervisor:
    """A supervisor over loader -> [target ->] drafter with toy actors. ``stages`` is 2
    (loader -> drafter over the batch ring) or 3 (with targets and a feature ring)."""
    if stages not in (2, 3):
        raise ValueError("stages is 2 or 3")

    def args(role):
        a = {"work_s": work_s, "fail_on_start": fail_on_start == role}
        if role == "target" and model:
            a["model"] = model
        if role == "drafter" and model:
            a["check_hidden"] = False
        return a

    rings = [RingSpec.batch("batch", runtime.batch_slots, token_budget, max_samples)]
    plan = [Stage("loader", ToyLoader, State.PLANNED, State.LOADED, out_ring="batch", args=args("loader"))]
    if stages == 3:
        rings.append(RingSpec.features("features", runtime.feature_slots, token_budget, max_samples,
                                       width, "bfloat16" if model else "float32"))
        plan.append(Stage("target", ToyTarget, State.LOADED, State.FEATURED, count=n_targets,
                          in_ring="batch", out_ring="features", args=args("target")))
        plan.append(Stage("drafter", ToySink, State.FEATURED, State.COMMITTED, count=n_drafters,
                          in_ring="features", ordered=True, args=args("drafter")))
    else:
        plan.append(Stage("drafter", ToySink, State.LOADED, State.COMMITTED, count=n_drafters,
                          in_ring="batch", ordered=True, args=args("drafter")))
    results = torch.full((n_batches,), -1, dtype=torch.int64).share_memory_()
    return Supervisor(runtime, plan, rings, n_batches, shared={"results": results}, on_stop=on_stop)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--work-s", type=float, default=0.0)
    p.add_argument("--fail-on-start", default=None, help="role whose actors raise in attach")
    p.add_argument("--set", action="append", default=[], help="runtime.KEY=VALUE")
    a = p.parse_args(argv)
    raw = {"run_dir": a.run_dir}
    for text in a.set:
        key, value = parse_override(text)
        raw[key.removeprefix("runtime.")] = value
    runtime = config_from_dict({"runtime": raw}).runtime
    result = toy_job(runtime, a.batches, stages=a.stages, work_s=a.work_s,
                     fail_on_start=a.fail_on_start).run()
    if result.exit_code:
        print(f"error: {result.reason}", file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
