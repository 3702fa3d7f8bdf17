"""The training job: loader -> target.0..N-1 -> drafter.0..M-1 -> optimizer, supervised.

``Job(cfg).run()`` is what ``launch.py`` calls. In the parent, before anything is
spawned, the constructor checks the input (``preflight``: devices, dataset structure
and token range, epoch plans; bad input raises and nothing is written to the run
directory), builds the tiny target if the config asks for it (once, not by N racing
actors) and loads the starting point (version 0, or the newest checkpoint).

``run`` then makes attempts until one ends for a reason other than a rollback: an
attempt allocates the shared state (``wiring.JobShared``), fills it with the starting
weights, and runs the supervisor over the stages ``wiring`` describes. When the
supervisor returns, for whatever reason (finished, signal, an actor that kept dying),
the actors are gone and the shared state is consistent, so the final checkpoint is
written from it here. If instead the optimizer found the committed state
untrustworthy (``RollbackRequired``), the attempt's state is dropped unwritten and the
next attempt starts from the newest checkpoint, at most ``runtime.max_restarts`` times.
With ``eval.every`` set, an ``evaluator`` process beside the supervisor reads the
published weights and appends held-out metrics to ``metrics.jsonl``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from . import report, wiring
from .actors.optimizer import RollbackRequired
from .batching import META_COLS
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
from .models.drafter import DFlashDrafter, build_drafter
from .models.head import target_info
from .models.target import resolve_dtype
from .params import ParamLayout
from .preflight import preflight
from .runtime.events import EventLog
from .runtime.supervisor import JobResult, JobState, Supervisor
from .schedule import Schedule
from .simulate import feature_width

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class RunResult:
    exit_code: int
    reason: str
    summary: dict
    committed: list[int] = field(default_factory=list)
    """Batch ids in the order the optimizer committed them, in the last attempt."""


@dataclass
class Start:
    """Where an attempt starts: the drafter module on CPU holding weight version
    ``version``, and the AdamW moments after it (None at version 0)."""

    model: DFlashDrafter
    version: int
    moments: Optional[dict] = None


def load_start(cfg: Config, target, run_dir: Path, resume: bool) -> Start:
    """Version 0 (``build_drafter`` honours ``drafter.init_from``), or with ``resume`` the
    newest complete checkpoint, refused if the config would change the math."""
    model = build_drafter(cfg, target)
    if not resume:
        if latest_checkpoint(run_dir) is not None:
            raise ConfigError(f"runtime.run_dir: {run_dir} already holds checkpoints; "
                              "pass --resume to continue it, or choose another --run-dir")
        return Start(model, 0)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise ResumeError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}")
    state = load_trainer_state(ckpt)
    check_resumable(state["config"], cfg.to_dict())
    model.load_state_dict(DFlashDrafter.from_pretrained(ckpt).state_dict())
    return Start(model, int(state["step"]), state["optimizer"])


class Job:
    """A prepared run: inputs checked, starting point loaded, nothing spawned yet.

    The constructor raises (ConfigError, DatasetError, ResumeError, ValueError) for bad
    input and writes nothing to the run directory; ``run`` does the rest."""

    def __init__(self, cfg: Config, resume: bool = False, progress: bool = True):
        self.t0 = time.perf_counter()
        self.cfg, self.run_dir, self.progress = cfg, Path(cfg.runtime.run_dir), progress
        self.pre = preflight(cfg, progress=progress)     # data first: it fails fastest
        self.target = target_info(cfg, "cpu")
        self.pre.dataset.check_values(self.target.vocab_size, progress=progress)
        self.schedule = schedule = Schedule.from_config(cfg, self.pre.dataset.lengths)
        if schedule.total_steps == 0:
            raise ConfigError(f"train.grad_accum: no optimizer step fits an epoch ({len(self.pre.plan0)} "
                              f"batches; a step needs grad_accum * drafters = {schedule.per_step})")
        self.start = load_start(cfg, self.target, self.run_dir, resume)
        self.layout = ParamLayout.of(self.start.model)
        self.shared = self._allocate()

    def _allocate(self) -> wiring.JobShared:
        """Fresh shared state holding the starting point."""
        shared = wiring.JobShared.allocate(self.layout, self.cfg, self.schedule)
        m = self.start.moments
        shared.weights.publish(self.start.version, list(self.start.model.parameters()),
                               None if m is None else self.layout.views(m["exp_avg"]),
                               None if m is None else self.layout.views(m["exp_avg_sq"]))
        return shared

    def run(self) -> RunResult:
        remove_partial(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
        rollbacks = 0
        while True:
            if self.start.version == self.schedule.total_steps:
                return self._finish(0, "already complete", {}, rollbacks)
            result = self._attempt()
            if not isinstance(result.raised, RollbackRequired):
                break
            ckpt = latest_checkpoint(self.run_dir)
            to = ckpt.name if ckpt else "start"
            with EventLog(self.run_dir / "events.log") as events:   # the supervisor's log, closed by now
                events.log("rollback", to=to, reason=str(result.raised))
            if rollbacks >= self.cfg.runtime.max_restarts:
                return self._finish(1, f"gave up after {rollbacks} rollbacks; last: {result.raised}",
                                    result.restarts, rollbacks)
            rollbacks += 1
            print(f"rolling back to {to}: {result.raised}", file=sys.stderr)
            self.start = load_start(self.cfg, self.target, self.run_dir, resume=ckpt is not None)
            self.shared = self._allocate()
        self._checkpoint()
        if result.state is JobState.FAILED and result.traceback:
            (self.run_dir / "error.txt").write_text(result.traceback)
        out = self._finish(result.exit_code, result.reason, result.restarts, rollbacks)
        out.committed = result.committed
        return out

    def _attempt(self) -> JobResult:
        """One supervisor run over this attempt's shared state."""
        cfg, sched, first = self.cfg, self.schedule, self.start.version
        feature_dtype = DTYPE_NAMES[resolve_dtype(cfg.target.dtype, torch.device(self.pre.devices.targets[0]))]
        width = feature_width(cfg, self.target)
        stages = wiring.stages(cfg, sched, self.pre.devices, self.shared, self.pre.train_path, first)
        progress = report.Progress(self.shared.step_stats, self.shared.weights, first, sched.total_steps,
                                   self.progress)
        sup = Supervisor(cfg.runtime, stages, wiring.rings(cfg, width, feature_dtype), sched.total_batches,
                         meta_cols=META_COLS, first_batch=sched.first_of_step(first),
                         num_threads=cfg.train.num_threads, on_status=progress)
        evaluator = None
        if cfg.eval.every and first < sched.total_steps:
            from .evaluator import Evaluator
            evaluator = Evaluator(cfg, self.shared.weights, self.run_dir, first, sched.total_steps)
            evaluator.start()
        try:
            return sup.run()
        finally:
            progress.close()
            if evaluator is not None:
                evaluator.finish(cfg.runtime.hang_timeout_s)

    def _checkpoint(self) -> Path:
        """The final checkpoint, from the shared state (consistent: no actor is left),
        and no leftovers of writes a kill cut short."""
        remove_partial(self.run_dir)
        store = self.shared.weights
        version = store.version
        last = latest_checkpoint(self.run_dir)
        if last is not None and last.name == f"step-{version:07d}":
            return last
        model = self.start.model
        store.load_params(list(model.parameters()), version)
        return save_checkpoint(self.run_dir, version, model.save_pretrained,
                               trainer_state(self.cfg, self.schedule, store, version))

    def _finish(self, exit_code: int, reason: str, restarts: dict, rollbacks: int) -> RunResult:
        summary = report.finish(self.run_dir, reason, self.shared.weights.version, self.schedule.total_steps,
                                self.start.version, self.shared.step_stats, time.perf_counter() - self.t0,
                                restarts, rollbacks, self.progress)
        if exit_code and exit_code != 130:
            print(f"error: {reason}", file=sys.stderr)
        return RunResult(exit_code, reason, summary)
