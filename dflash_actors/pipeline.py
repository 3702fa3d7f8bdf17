"""The training job: loader -> target.0..N-1 -> drafter.0..M-1 -> optimizer, supervised.

``Job(cfg).run()`` is what ``launch.py`` calls. In the parent, before anything is spawned:
preflight (devices, dataset structure and token range, epoch plans; bad input raises
and nothing is written to the run directory), the tiny target is built if the config
asks for it (once, not by N racing actors), and every shared buffer is allocated and
filled with weight version 0 (or the checkpoint's). Then the supervisor runs the four
stages over the ledger's batch ids. When it returns, for whatever reason (finished,
signal, an actor that kept dying), the actors are gone and the shared state is
consistent, so the final checkpoint is written from it here.

Stages and buffers::

    loader.0    PLANNED  -> LOADED     writes batch ring         (credit: batch slots)
    target.i    LOADED   -> FEATURED   batch ring -> feature ring
    drafter.j   FEATURED -> GRAD_DONE  feature ring -> grads[j]  (ordered: b % M == j)
    optimizer.0 GRAD_DONE-> COMMITTED  grads -> weights v+1      (ordered)
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .channels import RingSpec, rings_from_config
from .checkpoint import (
    ResumeError,
    check_resumable,
    latest_checkpoint,
    load_trainer_state,
    remove_partial,
    save_checkpoint,
    trainer_state,
)
from .config import Config, ConfigError, dump_config
from .dispatch import Stage
from .ledger import State
from .metrics import batch_table, read_steps, step_table
from .models.drafter import DFlashDrafter, build_drafter
from .models.head import target_info
from .models.target import resolve_dtype
from .params import GradAccumulators, ParamLayout, WeightStore
from .preflight import preflight
from .schedule import Schedule
from .supervisor import JobState, Supervisor

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class RunResult:
    exit_code: int
    reason: str
    summary: dict
    committed: list[int] = field(default_factory=list)
    """Ledger rows in the order the optimizer committed them (row r = batch start + r)."""


def _initial_state(cfg: Config, target, run_dir: Path, resume: bool):
    """(drafter module on CPU at the start version, version, saved moments or None).
    ``build_drafter`` honours ``drafter.init_from`` and checks it fits the target."""
    model = build_drafter(cfg, target)
    if not resume:
        if latest_checkpoint(run_dir) is not None:
            raise ConfigError(f"runtime.run_dir: {run_dir} already holds checkpoints; "
                              "pass --resume to continue it, or choose another --run-dir")
        return model, 0, None
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise ResumeError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}")
    state = load_trainer_state(ckpt)
    check_resumable(state["config"], cfg.to_dict())
    model.load_state_dict(DFlashDrafter.from_pretrained(ckpt).state_dict())
    return model, int(state["step"]), state["optimizer"]


class Job:
    """A prepared run: inputs checked, shared state allocated, nothing spawned yet.

    The constructor raises (ConfigError, DatasetError, ResumeError, ValueError) for bad
    input and writes nothing to the run directory; ``run`` does the rest."""

    def __init__(self, cfg: Config, resume: bool = False, progress: bool = True, rollbacks: int = 0):
        self.t0 = time.perf_counter()
        self.rollbacks = rollbacks
        self.cfg, self.run_dir, self.progress = cfg, Path(cfg.runtime.run_dir), progress
        self.pre = preflight(cfg, progress=progress)     # data first: it fails fastest
        target = target_info(cfg, "cpu")
        self.pre.dataset.check_values(target.vocab_size, progress=progress)
        self.schedule = schedule = Schedule.from_config(cfg, self.pre.dataset.lengths)
        if schedule.total_steps == 0:
            raise ConfigError(f"train.grad_accum: no optimizer step fits an epoch ({len(self.pre.plan0)} "
                              f"batches; a step needs grad_accum * drafters = {schedule.per_step})")
        self.model, self.version, moments = _initial_state(cfg, target, self.run_dir, resume)
        self.start = self.version * schedule.per_step
        layout = ParamLayout.of(self.model)
        self.store = WeightStore.allocate(layout)
        params = list(self.model.parameters())
        if moments is None:
            self.store.publish(self.version, params, None, None)
        else:
            self.store.publish(self.version, params, layout.views(moments["exp_avg"]),
                               layout.views(moments["exp_avg_sq"]))
        self.n_rows = schedule.total_batches - self.start
        self.shared = {"weights": self.store, "grads": GradAccumulators.allocate(layout, cfg.topology.num_drafters),
                       "stopping": torch.zeros(1, dtype=torch.int64).share_memory_(),
                       "rollback": torch.zeros(256, dtype=torch.uint8).share_memory_(),
                       "batch_stats": batch_table(max(self.n_rows, 1), cfg.drafter.block_size),
                       "step_stats": step_table(max(schedule.total_steps - self.version, 1))}
        self.width = len(target.layer_ids) * target.hidden_size

    def stages(self) -> tuple[list[Stage], list[RingSpec]]:
        cfg, devices = self.cfg, self.pre.devices
        from .actors.drafter import Drafter
        from .actors.loader import Loader
        from .actors.optimizer import Optimizer
        from .actors.target import Target
        feat_dtype = DTYPE_NAMES[resolve_dtype(cfg.target.dtype, torch.device(devices.targets[0]))]
        rt = cfg.runtime
        # The feature ring stays in (pinned) host memory even when a target and a drafter
        # share a GPU: the drafter reads batch fields through numpy views of the slot.
        rings = rings_from_config(cfg, self.width, feat_dtype)
        common = {"cfg": cfg, "schedule": self.schedule, "start": self.start}
        stages = [
            Stage("loader", Loader, State.PLANNED, State.LOADED, out_ring="batch", credit=rt.batch_slots,
                  args={**common, "train_path": self.pre.train_path}),
            Stage("target", Target, State.LOADED, State.FEATURED, count=cfg.topology.num_targets,
                  in_ring="batch", out_ring="features", credit=1, args={**common, "devices": devices.targets}),
            Stage("drafter", Drafter, State.FEATURED, State.GRAD_DONE, count=cfg.topology.num_drafters,
                  in_ring="features", ordered=True, args={**common, "devices": devices.drafters}),
            Stage("optimizer", Optimizer, State.GRAD_DONE, State.COMMITTED, ordered=True,
                  credit=self.schedule.per_step, args={**common, "device": devices.drafters[0]}),
        ]
        return stages, rings

    def run(self) -> RunResult:
        remove_partial(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
        if self.n_rows == 0:
            return self._finish(0, "already complete", {})
        stages, rings = self.stages()
        bar = tqdm(total=self.schedule.total_steps, initial=self.version, unit="step", desc="train",
                   disable=not self.progress, dynamic_ncols=True)
        self._sup = sup = Supervisor(
            self.cfg.runtime, stages, rings, self.n_rows, shared=self.shared, num_threads=self.cfg.train.num_threads,
            on_status=lambda st: self._progress(bar, st), on_stop=lambda reason: self.shared["stopping"].fill_(1))
        try:
            result = sup.run()
        finally:
            bar.close()
        if self.shared["rollback"][0]:
            return self._roll_back()
        self._checkpoint()
        if result.state is JobState.FAILED and result.traceback:
            (self.run_dir / "error.txt").write_text(result.traceback)
        out = self._finish(result.exit_code, result.reason, result.restarts)
        out.committed = result.committed
        return out

    def _rollback_reason(self) -> str:
        flag = self.shared["rollback"]
        return bytes(flag[1:].tolist()).rstrip(b"\0").decode(errors="replace")

    def _roll_back(self) -> RunResult:
        """The optimizer found the committed state untrustworthy: start again from the
        newest checkpoint (or from the beginning), without writing the bad state out."""
        ckpt = latest_checkpoint(self.run_dir)
        reason = self._rollback_reason()
        line = {"t": round(time.time(), 3), "event": "rollback", "to": ckpt.name if ckpt else "start",
                "reason": f"optimizer state inconsistent: {reason}"}
        with open(self.run_dir / "events.log", "a") as f:
            f.write(json.dumps(line) + "\n")
        if self.rollbacks >= self.cfg.runtime.max_restarts:
            return self._finish(1, f"gave up after {self.rollbacks} rollbacks; last: {reason}", {})
        print(f"rolling back to {line['to']}: {line['reason']}", file=sys.stderr)
        again = Job(self.cfg, resume=ckpt is not None, progress=self.progress, rollbacks=self.rollbacks + 1)
        again.t0 = self.t0
        return again.run()

    def _progress(self, bar, status: dict) -> None:
        """Each status tick: add the training position to status.json, move the bar, and
        turn an optimizer's rollback request into a stop."""
        if self.shared["rollback"][0] and self._sup.state is JobState.RUNNING:
            self._sup.request_stop(f"rollback: {self._rollback_reason()}")
        steps = read_steps(self.shared["step_stats"])
        last = steps[-1] if steps else {}
        status["training"] = {"step": self.store.version, "total_steps": self.schedule.total_steps,
                              "loss": last.get("loss"), "simulated_tau": last.get("tau"), "lr": last.get("lr"),
                              "tokens": int(sum(s["tokens"] for s in steps))}
        bar.update(self.store.version - bar.n)
        if steps:
            restarts = sum(a["restarts"] for a in status["actors"].values())
            bar.set_postfix(loss=f"{last['loss']:.3f}", tau=f"{last['tau']:.2f}", restarts=restarts, refresh=False)

    def _checkpoint(self) -> Path:
        """The final checkpoint, from the shared state (consistent: no actor is left)."""
        version = self.store.version
        last = latest_checkpoint(self.run_dir)
        if last is not None and last.name == f"step-{version:07d}":
            return last
        self.store.load_params(list(self.model.parameters()), version)
        return save_checkpoint(self.run_dir, version, self.model.save_pretrained,
                               trainer_state(self.cfg, self.schedule, self.store, version))

    def _finish(self, exit_code: int, reason: str, restarts: dict) -> RunResult:
        steps = read_steps(self.shared["step_stats"])
        wall = time.perf_counter() - self.t0
        tokens = int(sum(s["tokens"] for s in steps))
        last = steps[-1] if steps else {}
        ckpt = latest_checkpoint(self.run_dir)
        summary = {
            "result": reason, "step": self.store.version, "total_steps": self.schedule.total_steps,
            "steps_this_run": len(steps), "resumed_from": self.version, "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1), "wall_s": round(wall, 2),
            "loss": last.get("loss"), "simulated_tau": last.get("tau"),
            "restarts": sum(restarts.values()), "restarts_by_actor": {k: v for k, v in restarts.items() if v},
            "checkpoint": str(ckpt) if ckpt else None,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        (self.run_dir / "losses.json").write_text(json.dumps([s["loss"] for s in steps]))
        print(json.dumps(summary), flush=True)
        if self.progress:
            loss = f"{summary['loss']:.4f}" if steps else "-"
            tau = f"{summary['simulated_tau']:.3f}" if steps else "-"
            print(f"{reason}: step {summary['step']}/{summary['total_steps']}, loss {loss}, simulated tau {tau}, "
                  f"{summary['tokens_per_s']:.0f} tokens/s, {summary['wall_s']:.1f} s, "
                  f"{summary['restarts']} restarts; checkpoint {summary['checkpoint']}", file=sys.stderr)
        if exit_code and exit_code != 130:
            print(f"error: {reason}", file=sys.stderr)
        return RunResult(exit_code, reason, summary)
