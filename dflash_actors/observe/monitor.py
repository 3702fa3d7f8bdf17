"""What a running training job records and shows, from the supervisor's status hook
(about once a second, in the job's process; no actor waits for any of it):

- ``status.json`` gains a ``training`` block: step, epoch, loss, simulated tau, lr,
  tokens, tokens/s over the run and over the last 30 s, ETA;
- ``<run_dir>/metrics.jsonl`` gains one ``step`` line per optimizer step and a
  ``resources`` line every ``monitor.resources_every_s``; the evaluator appends its
  ``eval`` lines to the same file;
- TensorBoard scalars go to ``<run_dir>/tensorboard`` when the package is installed;
- the console (``console``) gets the live bar or a plain line every
  ``monitor.log_every_s``, and a line when an actor restarts or looks stuck.

metrics.jsonl, one JSON object a line, told apart by ``kind``::

    step       step (steps done after it, 1-based), epoch (1-based), time (unix), loss, tau (simulated),
               slot_acc [B-1] (training accuracy of draft positions 1..B-1), lr, grad_norm,
               tokens, tokens_per_s (over the step's interval), skipped (non-finite),
               stages {role: {busy_s, wait_s}}: busy_s = the seconds that role's work took
               on this step's batches (``Supervisor.work_times``), wait_s = its actors'
               remaining capacity over the step's interval (count x interval - busy_s).
               The interval runs from the previous step's end (the first: from when
               every actor was ready); tokens_per_s and wait_s are null where there is none
    resources  time, step, actors {id: {pid, rss_mb, cpu_pct, gpu_mem_mb, busy_pct}} (busy
               since the previous sample), supervisor {rss_mb, cpu_pct}, host {cpu_pct,
               mem_used_mb, mem_total_mb}, gpus [{index, util_pct, mem_used_mb}] (with pynvml)
    eval       see ``evaluator``

A resumed run appends: steps after its checkpoint that the first run had logged appear
again, and the later line is the one that counts. Lines are written whole, each with
one ``write`` on an ``O_APPEND`` descriptor, so the evaluator's lines never tear them.
The file is opened for each status (once a second), so that a path that stops being
writable mid-run fails the next append; that failure stops the job (``watch``'s
``on_error``), as one of events.log or status.json would, rather than leaving a run
that trains on unrecorded. Any other error of the monitor is a reporting bug: a
warning, and training goes on.

At the end ``accounting`` gives the summary's per-stage view: busy seconds and
fraction, the tokens/s each stage could sustain, and for the target and the drafter an
estimate of achieved TFLOP/s (``costmodel``'s FLOP counts for this run's batches) and
MFU against the device's peak.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import psutil
import torch

from .. import console
from ..runtime.files import cannot_write
from ..train.costmodel import ModelShape, Workload, drafter_flops_per_batch, target_flops_per_batch
from ..train.metrics import STEP_COLS, finite, fold_step
from ..train.schedule import Schedule

RATE_WINDOW_S = 30.0

# bf16 dense peak TFLOP/s of common training GPUs (vendor datasheets), for MFU; anything
# else needs ``monitor.peak_tflops``.
PEAK_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0,
               "A100": 312.0, "L40S": 362.0, "B200": 2250.0}


TENSORBOARD_QUEUE = 4096
"""Events TensorBoard's writer may hold before ``add_scalar`` waits for it to write (about
20 per step)."""


def _summary_writer():
    """``SummaryWriter``, or None where ``tensorboard`` is not installed."""
    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter


class Monitor:
    """What the job records and shows while one supervisor runs (module docstring);
    ``update`` is called with each status, through ``status.JobStatus``."""

    def __init__(self, cfg, schedule: Schedule, shared, first_step: int, enabled: bool):
        self.cfg, self.schedule, self.shared = cfg, schedule, shared
        self.run_dir = Path(cfg.runtime.run_dir)
        self.first = self.next = first_step
        self.enabled = enabled and console.mode() != "off"
        self.t_start = time.time()
        self.t_train: Optional[float] = None  # when every actor was first ready
        self.t_prev = self.t_start          # the previous step's end: the next one's interval starts there
        self.work_times: Optional[torch.Tensor] = None
        self.stages: list[tuple[str, int]] = []
        self.rates = collections.deque()    # (unix time, tokens) of recent steps
        self.tokens = 0
        self.last_line = self.last_start_line = 0.0
        self.last_sample: Optional[tuple[float, dict]] = None
        self.restarts: dict[str, int] = {}
        self.stuck: dict[str, Optional[str]] = {}
        self.ready_said = False
        self.block: Optional[dict] = None       # the newest training block
        self.shown = -1                         # the step of the last progress line
        self.tb = None
        self.tb_writer = _summary_writer() if cfg.monitor.tensorboard else None
        """TensorBoard's writer class, imported here: the import takes a fifth of a second,
        which inside ``update`` would hold up the supervisor's routing of batches."""
        self.failed = False
        self.on_error: Optional[Callable[[str], None]] = None
        self.unwritable = False             # metrics.jsonl failed: no more appends
        bar = console.mode() == "bar" and self.enabled
        self.bar = console.progress(schedule.total_steps, "train", "step", bar, initial=first_step) if bar else None

    def train_s(self) -> float:
        """Seconds since every actor was first ready (since the start, if never)."""
        return time.time() - (self.t_train if self.t_train is not None else self.t_start)

    def watch(self, work_times: torch.Tensor, stages, on_error: Optional[Callable[[str], None]] = None) -> None:
        """The supervisor's per-batch work times, its stages in column order, and what to
        call with the reason when metrics.jsonl cannot be written (its ``request_failure``;
        None: a warning, as for any other monitor error)."""
        self.work_times = work_times
        self.stages = [(s.role, s.count) for s in stages]
        self.on_error = on_error

    # -- the hook ---------------------------------------------------------------

    def update(self, status: dict) -> Optional[dict]:
        """Record and show what ``status`` (the supervisor's, as about to be written)
        says; returns its ``training`` block (the last good one after a failure)."""
        try:
            self.block = self._update(status)
        except Exception as e:  # noqa: BLE001 - a reporting bug must not stop the training
            if not self.failed:
                self.failed = True
                print(f"warning: monitor: {type(e).__name__}: {e}; metrics.jsonl may lack lines from here",
                      file=sys.stderr, flush=True)
        return self.block

    def _update(self, status: dict) -> dict:
        now = time.time()
        if self.t_train is None and all(st.get("phase") is None and st["pid"] for st in status["actors"].values()):
            # Rates count from the last actor's Ready: the start-up before it is not training
            # speed. Its time, not this poll's, so that the steps done between the two keep
            # their intervals (a fast start can finish several before the first poll).
            ready = [st.get("ready_at") for st in status["actors"].values()]
            self.t_train = self.t_prev = max(ready) if ready and None not in ready else now
        lines = [self._step_line(s) for s in self._new_steps()]
        step = self.shared.weights.version
        training = self._training(status, step, now)
        if now - (self.last_sample[0] if self.last_sample else 0.0) >= self.cfg.monitor.resources_every_s:
            lines.append(self._resources(status, now, step))
        self._append(lines)
        self._tensorboard([x for x in lines if x["kind"] == "step"])
        if self.enabled:
            self._show(status, training, now)
        return training

    def _new_steps(self) -> list[int]:
        table, done = self.shared.step_stats, STEP_COLS.index("done")
        out = []
        while self.next < self.schedule.total_steps and table[self.next, done] == 1.0:
            out.append(self.next)
            self.next += 1
        return out

    def _step_line(self, s: int) -> dict:
        row = dict(zip(STEP_COLS, self.shared.step_stats[s].tolist()))
        sched = self.schedule
        shards = [sched.drafter_batches(s, j) for j in range(sched.num_drafters)]
        stats, _ = fold_step(self.shared.batch_stats, shards)
        # A step that ended before the monitor saw every actor ready has no interval it
        # can measure: its rate and its stages' idle time are left out (null).
        interval = row["time"] - self.t_prev if row["time"] > self.t_prev else None
        self.t_prev = max(self.t_prev, row["time"])
        self.tokens += int(row["tokens"])
        self.rates.append((row["time"], int(row["tokens"])))
        batches = range(sched.first_of_step(s), sched.first_of_step(s + 1))
        stages = {}
        if self.work_times is not None:
            busy = self.work_times[batches.start:batches.stop].sum(0).tolist()
            for (role, count), b in zip(self.stages, busy):
                stages[role] = {"busy_s": round(b, 4),
                                "wait_s": round(max(0.0, count * interval - b), 4) if interval else None}
        skipped = bool(row["skipped"])
        m = stats.metrics()
        # A DFlash2's tau and slots are its selector's; its head's argmax and recall beside them.
        extra = {k: m[k] for k in ("tau_unary", "candidate_recall") if k in m and not skipped}
        return {"kind": "step", "step": s + 1, "epoch": sched.epoch_of_step(s) + 1, "time": round(row["time"], 3),
                "loss": None if skipped else row["loss"], "tau": None if skipped else row["tau"], **extra,
                "slot_acc": m["slot_acc"], "lr": row["lr"], "grad_norm": finite(row["grad_norm"]),
                "tokens": int(row["tokens"]), "tokens_per_s": round(row["tokens"] / interval, 1) if interval else None,
                "skipped": skipped, "stages": stages}

    def _training(self, status: dict, step: int, now: float) -> dict:
        while self.rates and now - self.rates[0][0] > RATE_WINDOW_S:
            self.rates.popleft()
        t_train = self.t_train if self.t_train is not None else now
        window = min(RATE_WINDOW_S, now - t_train)
        recent = sum(t for _, t in self.rates) / window if window > 1 and self.rates else None
        span = self.t_prev - t_train
        overall = self.tokens / span if self.next > self.first and span > 0 else None
        steps_30 = len(self.rates)
        left = self.schedule.total_steps - step
        eta = left / (steps_30 / window) if steps_30 and window > 1 else None
        table = self.shared.step_stats
        last = dict(zip(STEP_COLS, table[self.next - 1].tolist())) if self.next > self.first else {}
        skipped = int(table[self.first:self.next, STEP_COLS.index("skipped")].sum())
        return {"step": step, "total_steps": self.schedule.total_steps,
                "epoch": min(self.schedule.epoch_of_step(step) + 1, len(self.schedule.steps_per_epoch)),
                "total_epochs": len(self.schedule.steps_per_epoch),
                "loss": finite(last.get("loss")), "simulated_tau": finite(last.get("tau")), "lr": last.get("lr"),
                "tokens": self.tokens, "tokens_per_s": _round(overall), "tokens_per_s_30s": _round(recent),
                "eta_s": _round(eta), "skipped_steps": skipped}

    def _resources(self, status: dict, now: float, step: int) -> dict:
        prev_t, prev = self.last_sample if self.last_sample else (None, {})
        actors = {}
        for a, st in status["actors"].items():
            busy = None
            if prev_t is not None and a in prev and st.get("pid") == prev[a]["pid"]:
                busy = _round(min(100.0, max(0.0, 100 * (st["busy_s"] - prev[a]["busy_s"]) / (now - prev_t))))
            actors[a] = {"pid": st.get("pid"), "rss_mb": st.get("rss_mb"), "cpu_pct": st.get("cpu_pct"),
                         "gpu_mem_mb": st.get("gpu_mem_mb"), "busy_pct": busy}
        self.last_sample = (now, {a: {"pid": st.get("pid"), "busy_s": st.get("busy_s", 0.0)}
                                  for a, st in status["actors"].items()})
        mem = psutil.virtual_memory()
        line = {"kind": "resources", "time": round(now, 3), "step": step, "actors": actors,
                "supervisor": status.get("supervisor"),
                "host": {"cpu_pct": psutil.cpu_percent(None), "mem_used_mb": round((mem.total - mem.available) / 2**20),
                         "mem_total_mb": round(mem.total / 2**20)}}
        gpus = _gpus()
        if gpus:
            line["gpus"] = gpus
        return line

    def _append(self, lines: list[dict]) -> None:
        if not lines or self.unwritable:
            return
        path = self.run_dir / "metrics.jsonl"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                for x in lines:
                    os.write(fd, (json.dumps(x, allow_nan=False) + "\n").encode())
            finally:
                os.close(fd)
        except OSError as e:
            if self.on_error is None:
                raise
            self.unwritable = True
            self.on_error(cannot_write(path, e))

    def _tensorboard(self, steps: list[dict]) -> None:
        if not steps or not self.cfg.monitor.tensorboard:
            return
        if self.tb is None:
            if self.tb_writer is None:
                return
            # A resumed run rewrites the steps after its checkpoint, as metrics.jsonl does.
            # Its default queue of 10 events fills within a step, and every add_scalar
            # then waits for its writer thread: in the supervisor's loop, where every
            # batch's Done is read. Room for a minute of steps never waits.
            self.tb = self.tb_writer(str(self.run_dir / "tensorboard"), purge_step=self.first + 1,
                                     max_queue=TENSORBOARD_QUEUE)
        for x in steps:
            scalars = {"train/loss": x["loss"], "train/simulated_tau": x["tau"], "train/lr": x["lr"],
                       "train/grad_norm": x["grad_norm"], "perf/tokens_per_s": x["tokens_per_s"],
                       **{f"train/slot_acc/{k + 1}": a for k, a in enumerate(x["slot_acc"])},
                       **{f"perf/busy_s/{r}": v["busy_s"] for r, v in x["stages"].items()}}
            for tag, v in scalars.items():
                if v is not None:
                    self.tb.add_scalar(tag, v, x["step"], walltime=x["time"])

    # -- the console --------------------------------------------------------------

    def _show(self, status: dict, training: dict, now: float) -> None:
        for a, st in status["actors"].items():
            if st["restarts"] > self.restarts.get(a, 0):
                console.say(f"{a} restarted (restart {st['restarts']}; events.log says why)")
            if st.get("stuck") and not self.stuck.get(a):
                console.say(f"{a} looks stuck: {st['stuck']}")
            self.restarts[a], self.stuck[a] = st["restarts"], st.get("stuck")
        # The fork server's loss restarts every actor, as one event (its own warning line).
        self.restarts["forkserver"] = status.get("forkserver_restarts") or 0
        ready = [a for a, st in status["actors"].items() if st.get("phase") is None and st["pid"]]
        if not self.ready_said:
            if len(ready) == len(status["actors"]):
                self.ready_said = True
                console.say(f"all {len(ready)} actors ready after {now - self.t_start:.1f} s; training")
            elif now - self.last_start_line >= min(10.0, self.cfg.monitor.log_every_s) and now - self.t_start > 1:
                self.last_start_line = now
                console.say(starting_line(status, len(ready)))
        if self.bar is not None:
            self.bar.update(training["step"] - self.bar.n)
            if training["loss"] is not None:
                self.bar.set_postfix(loss=f"{training['loss']:.4f}", tau=f"{training['simulated_tau']:.2f}",
                                     restarts=sum(self.restarts.values()), refresh=False)
        elif self.next > self.first and now - self.last_line >= self.cfg.monitor.log_every_s:
            self.last_line, self.shown = now, training["step"]
            console.say(progress_line(training, sum(self.restarts.values())))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.block is not None and self.block["step"] != self.shown and self.next > self.first:
            # The log ends where training did, not up to log_every_s before.
            console.say(progress_line(self.block, sum(self.restarts.values())))
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def progress_line(t: dict, restarts: int) -> str:
    """``step 42/160 (26%) epoch 10/40 | loss 5.1234 tau 1.52 lr 3.0e-04 | 3012 tok/s | eta 0:00:38 | 0 restarts``"""
    loss = f"{t['loss']:.4f}" if t["loss"] is not None else "-"
    tau = f"{t['simulated_tau']:.2f}" if t["simulated_tau"] is not None else "-"
    lr = f"{t['lr']:.1e}" if t["lr"] is not None else "-"
    rate = t["tokens_per_s_30s"] if t["tokens_per_s_30s"] is not None else t["tokens_per_s"]
    rate = f"{rate:.0f}" if rate is not None else "-"
    return (f"step {t['step']}/{t['total_steps']} ({100 * t['step'] / max(t['total_steps'], 1):.0f}%) "
            f"epoch {t['epoch']}/{t['total_epochs']} | loss {loss} tau {tau} lr {lr} | "
            f"{rate} tok/s | eta {console.hms(t['eta_s'])} | {restarts} restarts"
            + (f" | {t['skipped_steps']} skipped steps" if t["skipped_steps"] else ""))


def starting_line(status: dict, ready: int) -> str:
    """``starting: 4/6 actors ready | load target weights: target.0 3/12, target.1 (14 s)``:
    the actors not ready yet, by phase, with the longest time spent in it."""
    phases: dict[str, list] = {}
    for a, st in status["actors"].items():
        p = st.get("phase")
        if p is not None:
            counts = f" {p['done']}/{p['total']}" if p.get("total") else ""
            phases.setdefault(p["name"], []).append((f"{a}{counts}", p["elapsed_s"]))
    groups = [f"{name}: {', '.join(a for a, _ in who)} ({max(t for _, t in who):.0f} s)"
              for name, who in phases.items()]
    return " | ".join([f"starting: {ready}/{len(status['actors'])} actors ready", *groups])


# -- the end of a run ---------------------------------------------------------------


def accounting(cfg, target_config, layer_ids: list[int], schedule: Schedule, step_stats: torch.Tensor,
               batch_stats: torch.Tensor, work_times: Optional[torch.Tensor], stages: list[tuple[str, int]],
               first_step: int, wall_s: float, seqs_per_batch: float, devices: dict[str, str]) -> dict:
    """Per stage: busy seconds and fraction of its actors' time, and the tokens/s it
    could sustain with all its actors busy; for the target and the drafter also the
    estimated TFLOP/s each device achieved while busy, and MFU where the peak is known."""
    steps = [dict(zip(STEP_COLS, r.tolist())) for r in step_stats[first_step:] if r[-1] == 1.0]
    if work_times is None or not steps or wall_s <= 0:
        return {}
    lo, hi = schedule.first_of_step(first_step), schedule.first_of_step(first_step + len(steps))
    tokens = sum(s["tokens"] for s in steps)
    busy = work_times[lo:hi].sum(0).tolist()
    batches = hi - lo
    blocks = float(batch_stats[lo:hi, 0].sum())
    shape = _shape(target_config, layer_ids, whole=cfg.train.loss == "distill")
    work = Workload(token_budget=max(1, round(tokens / batches)), sequences_per_batch=max(1, round(seqs_per_batch)),
                    anchors=max(1, round(blocks / batches / max(seqs_per_batch, 1))),
                    block_size=cfg.drafter.block_size, feature_layers=len(layer_ids),
                    drafter_layers=cfg.drafter.num_layers)
    flops = {"target": target_flops_per_batch(shape, work) * batches,
             "drafter": drafter_flops_per_batch(shape, work) * batches}
    out = {}
    for (role, count), b in zip(stages, busy):
        row = {"actors": count, "busy_s": round(b, 2), "busy_fraction": round(b / (count * wall_s), 4),
               "tokens_per_s": round(tokens * count / b, 1) if b > 0 else None}
        if role in flops and b > 0:
            # A target gang's busy time is its rank 0's, and K devices did that work.
            per = cfg.topology.target_tp if role == "target" else 1
            tflops = flops[role] / b / 1e12 / per
            peak = peak_tflops(cfg, devices.get(role, "cpu"))
            row.update(tflops=_sig(tflops), peak_tflops=peak, mfu=_sig(tflops / peak) if peak else None)
        out[role] = row
    return out


def peak_tflops(cfg, device: str) -> Optional[float]:
    if cfg.monitor.peak_tflops is not None:
        return cfg.monitor.peak_tflops
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def _shape(c, layer_ids: list[int], whole: bool = False) -> ModelShape:
    """The target's shape, cut at the deepest layer the features need (the forward stops
    there), or ``whole`` when distillation needs its last layer too."""
    heads = int(c.num_attention_heads)
    depth = int(c.num_hidden_layers) if whole else max(layer_ids) + 1
    return ModelShape("target", int(c.hidden_size), depth, int(c.intermediate_size), heads,
                      int(getattr(c, "num_key_value_heads", None) or heads),
                      int(getattr(c, "head_dim", None) or c.hidden_size // heads), int(c.vocab_size))


def _gpus() -> list[dict]:
    """Per-GPU utilisation and memory through NVML, when nvidia-ml-py is installed."""
    if importlib.util.find_spec("pynvml") is None:
        return []
    try:
        import pynvml
        pynvml.nvmlInit()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            util, mem = pynvml.nvmlDeviceGetUtilizationRates(h), pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append({"index": i, "util_pct": float(util.gpu), "mem_used_mb": round(mem.used / 2**20)})
        return out
    except Exception:   # noqa: BLE001 - no driver, no permission: a sample without GPUs
        return []


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 1)
