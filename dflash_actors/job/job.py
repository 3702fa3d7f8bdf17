"""The training job: loader -> target.0..N-1 -> drafter.0..M-1 -> optimizer, supervised.

``Job(cfg, pre=...).run()`` is what ``launch.py`` calls. In the parent, before
anything is spawned, the constructor takes the checked input (``preflight``: the run
directory, devices, dataset structure and token range, the target's shape, with the
tiny default built once rather than by N racing actors, and the schedule; bad input
raises and nothing is written to the run directory), then takes the run directory's
lock (``rundir``: one job per directory, held until ``run`` returns) and loads the
starting point (version 0, or the newest checkpoint that verifies).

``run`` then makes attempts until one ends for a reason other than a rollback: an
attempt allocates the shared state (``wiring.JobShared``), fills it with the starting
weights, and runs the supervisor over the stages ``wiring`` describes and the job's
slot rings (allocated by the first attempt and kept, so a rollback does not leave the
previous attempt's GPU ring allocated beside a new one). When the supervisor
returns, for whatever reason (finished, signal, an actor that kept dying), the actors
are gone and the shared state is consistent, so the final checkpoint is
written from it here. If instead the optimizer found the committed state
untrustworthy (``RollbackRequired``), the attempt's state is dropped unwritten and the
next attempt starts from the newest checkpoint that verifies (version 0 if none does),
at most ``runtime.max_restarts`` times.
With ``target.feature_cache`` on, the constructor plans the cache (``train.feature_cache``)
and ``run`` opens it once for every attempt: shared memory handed to the targets, or
``<run_dir>/feature-cache`` kept across resumes; its counters go to status.json and
summary.json as ``feature_cache``.
With ``eval.every`` set, an ``evaluator`` process beside the supervisor reads the
published weights and appends held-out metrics to ``metrics.jsonl``.

Across machines (``topology.nodes`` > 1, ``cluster``) each machine runs one Job for
its node: before anything spawns, every node meets the others and checks they run the
same job, node 0 loads the starting point and sends it to the rest, and a ``Link``
thread beside the supervisor makes each step's cross-node exchange. Only node 0 writes
checkpoints and runs the evaluator; a lost node fails the job on the others (node 0
still writes its final checkpoint: its state is consistent). A rollback would need
every node, so across machines it ends the job instead; ``--resume`` on all continues.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .. import console
from ..actors.optimizer import RollbackRequired
from ..cluster.link import Link, digest
from ..cluster.node import NodeSpec
from ..config import Config, ConfigError, dump_config
from ..console import first_line
from ..data.batching import META_COLS
from ..models import shared_weights
from ..models.drafter import DFlashDrafter
from ..models.drafter_start import build_drafter
from ..models.target import resolve_dtype
from ..observe import report
from ..observe.monitor import Monitor, accounting
from ..observe.status import JobStatus
from ..runtime.channels import Ring, dtype_name
from ..runtime.events import EventLog
from ..runtime.faults import strike_self
from ..runtime.forking import ForkServerStarter
from ..runtime.outcome import JobResult, JobState
from ..runtime.supervisor import Supervisor
from ..train import feature_cache
from ..train.checkpoint import (
    MANIFEST,
    STATE_FILE,
    CheckpointError,
    ForeignFileError,
    ResumeError,
    check_resumable,
    drafter_change,
    has_manifest,
    latest_checkpoint,
    list_checkpoints,
    load_trainer_state,
    math_changes,
    newest_usable,
    remove_partial,
    save_checkpoint,
    trainer_state,
    verified_checkpoint,
)
from ..train.params import ParamLayout
from ..train.simulate import feature_width
from . import rundir, wiring
from .preflight import Preflight, preflight, resolved


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
    ``version``, the AdamW moments after it (None at version 0), and the checkpoint
    they came from (None at version 0)."""

    model: DFlashDrafter
    version: int
    moments: Optional[dict] = None
    checkpoint: Optional[Path] = None
    applied: int = 0
    """Batches the steps up to ``version`` consumed (``WeightStore.applied``)."""


def load_start(cfg: Config, model: DFlashDrafter, run_dir: Path, resume: bool) -> Start:
    """Version 0 (``model``, as ``build_drafter`` made it), or with ``resume`` the newest
    checkpoint that verifies and loads, refused if the config would change the math.

    A resume whose checkpoints all fail raises, naming each one and why; one whose job
    was stopped before its first checkpoint (config.yaml, no checkpoint) starts over,
    saying so on stderr."""
    if not resume:
        if list_checkpoints(run_dir):
            raise ConfigError(f"runtime.run_dir: {run_dir} already holds checkpoints; "
                              "pass --resume to continue it, or choose another --run-dir")
        return Start(model, 0)
    start, skipped = checkpoint_start(cfg, model, run_dir)
    if start is not None:
        return start
    if skipped:
        why = "; ".join(f"{p.name}: {w}" for p, w in skipped)
        raise ResumeError(f"--resume: no checkpoint under {run_dir / 'checkpoints'} verifies ({why})")
    if not (run_dir / rundir.SAVED_CONFIG).is_file():
        raise ResumeError(f"--resume: {run_dir} is not a run directory (no config.yaml, no complete checkpoint)")
    print(f"--resume: {run_dir} has no checkpoint yet (its job stopped before the first); "
          "starting it from the beginning", file=sys.stderr)
    return Start(model, 0)


def checkpoint_start(cfg: Config, model: DFlashDrafter, run_dir: Path) -> tuple[Optional[Start], list]:
    """The newest checkpoint that verifies and loads, as a Start (None if none does), and
    the newer ones passed over with the reason. When one is found, each passed over gets
    a line on stderr, as does a checkpoint without a manifest (accepted unchecked)."""
    found = newest_usable(run_dir, _load_checkpoint)
    if found.path is None:
        return None, found.skipped
    for p, why in found.skipped:
        print(f"skipping checkpoint {p.name}: {why}; resuming from {found.path.name}", file=sys.stderr)
    if not has_manifest(found.path):
        print(f"warning: checkpoint {found.path.name} has no {MANIFEST} (written before checksums); "
              "resuming from it unverified", file=sys.stderr)
    state, weights = found.loaded
    check_resumable(state["config"], cfg.to_dict())
    line = drafter_change(state["config"], cfg.to_dict())
    if line:
        print(line, file=sys.stderr)
    model.load_state_dict(weights)
    # Checkpoints from before batch counting: the count a complete lineage has.
    applied = int(state.get("batches_applied", state.get("next_batch", 0)))
    return Start(model, int(state["step"]), state["optimizer"], found.path, applied), found.skipped


def _load_checkpoint(ckpt: Path) -> tuple[dict, dict]:
    state = load_trainer_state(ckpt)
    missing = [k for k in ("step", "config", "optimizer") if k not in state]
    if missing:
        raise CheckpointError(f"{STATE_FILE} lacks {missing}")
    return state, DFlashDrafter.from_pretrained(ckpt).state_dict()


class Job:
    """A prepared run: inputs checked, starting point loaded, nothing spawned yet.

    The constructor raises (ConfigError, DatasetError, ResumeError, RunDirError,
    ValueError) for bad input. Nothing is written to the run directory before the input
    is valid, and then only the lock file (a refused resume leaves just that); ``run``
    does the rest and releases the lock."""

    def __init__(self, cfg: Config, resume: bool = False, progress: bool = True, node: Optional[NodeSpec] = None,
                 pre: Optional[Preflight] = None, forkserver: Optional[ForkServerStarter] = None):
        """``pre``: the preflight of ``cfg`` for this node, when the caller made it
        (``launch.py`` does); None: made here. ``forkserver``: a server the caller
        started for every attempt's actors (``job.forkserver``); None: each attempt's
        supervisor starts its own."""
        self.t0 = time.perf_counter()
        self.forkserver = forkserver
        self.cfg, self.run_dir, self.progress = cfg, Path(cfg.runtime.run_dir), progress
        self.node = node = node or NodeSpec()
        self.link: Optional[Link] = None
        self.accounts: dict = {}
        if cfg.topology.nodes != node.nodes:
            raise ConfigError(f"topology.nodes: {cfg.topology.nodes}, but this launch is {node.describe()}; "
                              "launch.py sets it from --nnodes or the torchrun/SLURM environment")
        self.pre = pre or preflight(cfg, node.rank, progress)
        self.cfg = cfg = resolved(cfg, self.pre)
        self.target, self.schedule = self.pre.target, self.pre.schedule
        self.cache: Optional[feature_cache.FeatureCache] = None
        self.rings: Optional[list[Ring]] = None
        self.weights: Optional[shared_weights.SharedWeights] = None
        self.share = self._share_decision()     # share_weights on that cannot fit: exit 2 now
        self.cache_plan = None
        if cfg.target.feature_cache != "off":
            with console.phase("plan the feature cache", progress):
                self.cache_plan = feature_cache.plan_job(cfg, self.pre.dataset.lengths, self.pre.plan0,
                                                         *self._feature_format())
        bulk = bulk_device(cfg, self.pre.devices.drafters[0]) if node.nodes > 1 else None
        with console.phase("build drafter", progress):
            model = build_drafter(cfg, self.target)      # checks drafter.init_from
        # The input is valid: from here on the directory is this job's. Checkpoints are
        # read under the lock, so never while another job writes them.
        self.lock = rundir.RunDirLock(self.run_dir)
        self.lock.acquire()
        try:
            if node.rank == 0:
                with console.phase("verify and load the checkpoint" if resume else "prepare the start", progress):
                    self.start = load_start(cfg, model, self.run_dir, resume)
            else:
                self.start = Start(model, 0)    # node 0's, once the nodes have met
            self.layout = ParamLayout.of(self.start.model)
            if node.nodes > 1:
                self.link = Link(node, cfg.runtime, bulk)
                with console.phase(f"meet the other nodes ({node.describe()})", progress):
                    self.link.join(self._fingerprint(), same_job)
                with console.phase("receive node 0's starting point" if node.rank else "send the starting point",
                                   progress):
                    self._share_start()
            self.shared = self._allocate()
        except BaseException as e:
            if self.link is not None:
                self.link.finish("failed", 0, first_line(e), "")    # the others stop now, not at their timeout
                self.link.close()
            self.lock.release()
            raise

    def _feature_format(self) -> tuple[int, str]:
        """Width and dtype name of the target's features: the feature slots' and the cache's."""
        return feature_width(self.cfg, self.target), dtype_name(self._target_dtype())

    def _target_dtype(self) -> torch.dtype:
        """What the targets compute in (the first target's device decides auto)."""
        return resolve_dtype(self.cfg.target.dtype, torch.device(self.pre.devices.targets[0]))

    def _share_decision(self) -> Optional[tuple[bool, str]]:
        """Whether the targets will share their weights, and the line that says so
        (``target.share_weights``; None under simulation: no target runs)."""
        if self.cfg.runtime.simulate.enabled:
            return None
        from ..models.target import ensure_target

        top = self.cfg.topology
        return shared_weights.decide(self.cfg.target.share_weights,
                                     shared_weights.weight_bytes(ensure_target(self.cfg), self._target_dtype()),
                                     top.num_targets, ranks=top.target_tp)

    def _share_weights(self) -> None:
        """The target's weights in shared memory for the job's life, when
        ``_share_decision`` says so: every target maps them, every rank of a gang
        slices its shard from them (``models.shared_weights``)."""
        if self.share is None:
            return
        from ..models.target import ensure_target

        share, line = self.share
        if share:
            def midway():
                with EventLog(self.run_dir / "events.log") as events:
                    strike_self(self.cfg.runtime.faults, "share_weights",
                                self.schedule.first_of_step(self.start.version), self.run_dir, events.log)
            with console.phase("read the target weights into shared memory", self.progress):
                self.weights = shared_weights.share_target(ensure_target(self.cfg), self._target_dtype(), midway)
        if self.progress:
            console.say(line)

    def _open_cache(self) -> None:
        """The feature cache the targets share, for the job's life (a rollback keeps it:
        its entries are the same bits whatever the attempt)."""
        plan, whole = self.cache_plan
        self.cache, line = feature_cache.open_job(self.cfg, plan, whole, self.pre.train_path, self.target.layer_ids,
                                                  self.run_dir, self.cfg.topology.num_targets)
        if line:
            print(line, file=sys.stderr)
        if self.progress:
            print(self.cache.describe(), file=sys.stderr)

    def _fingerprint(self) -> dict:
        """What every node must agree on: the config's math, the data, the drafter."""
        return {"config": self.cfg.to_dict(), "steps_per_epoch": list(self.schedule.steps_per_epoch),
                "tokens": int(self.pre.dataset.num_tokens), "params": self.layout.numel}

    def _share_start(self) -> None:
        """Node 0's starting point (version, batches, weights, moments) on every node."""
        P, st = self.layout.numel, self.start
        header = torch.zeros(3, dtype=torch.int64)
        body = torch.zeros(3, P)
        if self.node.rank == 0:
            header[:] = torch.tensor([st.version, st.applied, st.moments is not None])
            body[0] = torch.cat([p.detach().reshape(-1) for p in st.model.parameters()])
            if st.moments is not None:
                body[1], body[2] = st.moments["exp_avg"], st.moments["exp_avg_sq"]
        self.link.broadcast_start(header, body)
        if self.node.rank == 0:
            return
        version, applied, moments = (int(x) for x in header)
        with torch.no_grad():
            for p, w in zip(st.model.parameters(), self.layout.views(body[0])):
                p.copy_(w)
        self.start = Start(st.model, version, {"exp_avg": body[1], "exp_avg_sq": body[2]} if moments else None,
                           None, applied)

    def _allocate(self) -> wiring.JobShared:
        """Fresh shared state holding the starting point."""
        shared = wiring.JobShared.allocate(self.layout, self.cfg, self.schedule)
        m = self.start.moments
        shared.weights.publish(self.start.version, list(self.start.model.parameters()),
                               None if m is None else self.layout.views(m["exp_avg"]),
                               None if m is None else self.layout.views(m["exp_avg_sq"]), applied=self.start.applied)
        return shared

    def run(self) -> RunResult:
        try:
            return self._run()
        finally:
            if self.link is not None:
                self.link.close()
            self.lock.release()

    def _run(self) -> RunResult:
        remove_partial(self.run_dir)        # no writer but us: every temporary is a leftover
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / rundir.SAVED_CONFIG).write_text(dump_config(self.cfg))
        rollbacks = 0
        if self.start.version < self.schedule.total_steps:
            self._share_weights()       # once: a rollback keeps the job's copy
        while True:
            if self.start.version == self.schedule.total_steps:
                return self._finish(0, "already complete", {}, rollbacks)
            if self.cache_plan is not None and self.cache is None:
                try:
                    self._open_cache()
                except ConfigError as e:     # a disk that cannot hold it
                    return self._finish(2, str(e), {}, rollbacks)
            result = self._attempt()
            if not isinstance(result.raised, RollbackRequired):
                break
            if self.link is not None:
                result.reason += "; a rollback needs every node: relaunch them all with --resume"
                break
            if rollbacks >= self.cfg.runtime.max_restarts:
                return self._finish(1, f"gave up after {rollbacks} rollbacks; last: {result.raised}",
                                    result.restarts, rollbacks)
            rollbacks += 1
            model = build_drafter(self.cfg, self.target)
            try:
                start, _ = checkpoint_start(self.cfg, model, self.run_dir)
            except ForeignFileError as e:   # planted while we ran: refused, nothing in it run
                return self._finish(2, str(e), result.restarts, rollbacks)
            self.start = start or Start(model, 0)
            to = start.checkpoint.name if start else "start"
            with EventLog(self.run_dir / "events.log") as events:   # the supervisor's log, closed by now
                events.log("rollback", to=to, reason=str(result.raised))
            print(f"rolling back to {to}: {result.raised}", file=sys.stderr)
            self.shared = self._allocate()
        try:
            self._checkpoint()
        except OSError as e:
            last = latest_checkpoint(self.run_dir)
            return self._finish(1, f"final checkpoint (step {self.shared.weights.version}) not written: "
                                   f"{e.strerror or first_line(e)}; the newest checkpoint is "
                                   f"{last.name if last else 'none'}", result.restarts, rollbacks)
        if result.state is JobState.FAILED and result.traceback:
            (self.run_dir / "error.txt").write_text(result.traceback)
        out = self._finish(result.exit_code, result.reason, result.restarts, rollbacks)
        out.committed = result.committed
        return out

    def _attempt(self) -> JobResult:
        """One supervisor run over this attempt's shared state."""
        cfg, sched, first = self.cfg, self.schedule, self.start.version
        stages = wiring.stages(cfg, sched, self.pre.devices, self.shared, self.pre.train_path, first, self.cache,
                               self.weights)
        monitor = Monitor(cfg, sched, self.shared, first, self.progress)
        rings = self._rings()
        on_status = JobStatus(monitor, self.link)
        if self.cache is not None:
            on_status = with_cache_status(on_status, self.cache)
        sup = Supervisor(cfg.runtime, stages, rings, sched.total_batches,
                         meta_cols=META_COLS, first_batch=sched.first_of_step(first),
                         num_threads=cfg.train.num_threads, on_status=on_status, forkserver=self.forkserver,
                         supervisor_points=wiring.SUPERVISOR_POINTS)
        monitor.watch(sup.work_times, stages, sup.request_failure)
        if self.link is not None:
            sh = self.shared
            self.link.serve(sh.exchange, sh.grads, sh.batch_stats, sh.weights, sched, first, sup.request_failure)
        evaluator = None
        if cfg.eval.every and first < sched.total_steps and self.node.rank == 0:
            from ..eval.evaluator import Evaluator
            evaluator = Evaluator(cfg, self.shared.weights, self.run_dir, first, sched.total_steps)
            evaluator.start(sup.request_failure, sup.request_finish)
        try:
            return sup.run()
        finally:
            if self.link is not None:
                self.link.stop()
            monitor.close()
            self.accounts = self._accounting(monitor, first)
            if evaluator is not None:
                evaluator.finish(cfg.runtime.hang_timeout_s)

    def _rings(self) -> list[Ring]:
        """The slot rings, allocated by the first attempt and handed to every later one.
        A dropped CUDA ring is not freed (its consumers never release their IPC counts),
        so a ring per attempt would leave each rollback's beside the next; and what a slot
        holds never matters across attempts: each attempt's ledger decides."""
        if self.rings is None:
            width, feature_dtype = self._feature_format()
            specs = wiring.rings(self.cfg, width, feature_dtype, self.pre.devices.features)
            self.rings = [Ring.allocate(spec) for spec in specs]
        return self.rings

    def _accounting(self, monitor: Monitor, first: int) -> dict:
        devices = {"target": self.pre.devices.targets[0], "drafter": self.pre.devices.drafters[0]}
        stats = self.pre.plan0.stats(self.pre.dataset.lengths, self.cfg.batching.token_budget)
        return accounting(self.cfg, self.target.config, self.target.layer_ids, self.schedule,
                          self.shared.step_stats, self.shared.batch_stats, monitor.work_times, monitor.stages,
                          first, monitor.train_s(), stats["mean_samples"], devices)

    def _checkpoint(self) -> Optional[Path]:
        """The final checkpoint, from the shared state (consistent: no actor is left),
        and no leftovers of writes a kill cut short. One of this version that verifies
        is kept; a damaged one is rewritten.

        A failed write (a full disk) raises: ``run`` ends the job with one line and
        exit 1. Unlike a periodic checkpoint, which the optimizer skips and retries at
        the next interval while training goes on, the final one has no next interval:
        ending "finished" with the end state unsaved would lose the run's last stretch
        silently. The previous checkpoint is intact and ``--resume`` continues from it
        once there is room.

        Across machines only node 0 writes (the others return None)."""
        if self.node.rank:
            return None
        remove_partial(self.run_dir)
        store = self.shared.weights
        version = store.version
        done = verified_checkpoint(self.run_dir, version)
        if done is not None:
            return done
        model = self.start.model
        store.load_params(list(model.parameters()), version)
        return save_checkpoint(self.run_dir, version, model.save_pretrained,
                               trainer_state(self.cfg, self.schedule, store, version))

    def _finish(self, exit_code: int, reason: str, restarts: dict, rollbacks: int) -> RunResult:
        dev, rt = self.pre.devices, self.cfg.runtime
        extra = {"placement": {"targets": list(dev.targets), "drafters": list(dev.drafters),
                               "feature_ring": dev.features, "grad_durability": rt.grad_durability}}
        if self.cache is not None:
            extra["feature_cache"] = self.cache.stats()
        if self.link is not None:
            store = self.shared.weights
            state = {0: "done", 130: "stopped"}.get(exit_code, "failed")
            extra["cluster"] = self.link.finish(state, store.version, reason, digest(store, store.version))
        summary = report.finish(self.run_dir, reason, self.shared.weights.version, self.schedule.total_steps,
                                self.start.version, self.shared.step_stats, time.perf_counter() - self.t0,
                                restarts, rollbacks, self.progress, self.accounts, extra)
        if self.cache is not None and self.progress:
            print(self.cache.result_line(), file=sys.stderr)
        if exit_code and exit_code != 130:
            print(f"error: {reason}", file=sys.stderr)
        return RunResult(exit_code, reason, summary)


def with_cache_status(hook, cache: feature_cache.FeatureCache):
    """``hook``, then the ``feature_cache`` block of status.json: ``FeatureCache.stats``."""
    def on_status(status: dict) -> None:
        hook(status)
        status["feature_cache"] = cache.stats()
    return on_status


def same_job(mine: dict, theirs: dict) -> list[str]:
    """What differs between two nodes' ``Job._fingerprint``: config keys that change the
    math, the per-node shape of the step, the plan, the data, the drafter."""
    a, b = mine["config"], theirs["config"]
    diff = math_changes(a, b)
    diff += [f"topology.{k}" for k in ("num_drafters", "nodes") if a["topology"][k] != b["topology"][k]]
    diff += ["train.grad_accum"] if a["train"]["grad_accum"] != b["train"]["grad_accum"] else []
    return diff + [k for k in ("steps_per_epoch", "tokens", "params") if mine[k] != theirs[k]]


def bulk_device(cfg: Config, drafter_device: str) -> Optional[str]:
    """Where the cross-node gradient chain runs: the first drafter's CUDA device
    (NCCL), or None (gloo, host memory)."""
    backend, on_cuda = cfg.runtime.collective_backend, drafter_device.startswith("cuda")
    if backend == "nccl" and not on_cuda:
        raise ConfigError(f"runtime.collective_backend: nccl needs the drafters on CUDA devices (got {drafter_device})")
    return drafter_device if on_cuda and backend != "gloo" else None
