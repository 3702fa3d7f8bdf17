"""``<run_dir>/status.json``: how a running job is doing, rewritten about once a second.

One writer: the job's supervisor (``runtime.supervisor``) writes the file atomically
(``runtime.files``) about once a second and a last time when it stops. Before each
write it calls the training job's hook, ``JobStatus``, which adds the job's blocks to
the runtime's own; nothing else adds to it. Readers go through ``read``: ``launch.py
status`` (``statusview``) and the chaos driver (``tools.chaos``).

The schema, one JSON object (a value not known yet is null; readers must allow any
key to be missing, as files from older runs lack newer keys)::

    time                unix time of this write
    state               running | stopping | done | stopped | failed
    reason              why it is stopping or stopped (null while running)
    supervisor_pid      the supervisor process; supervisor_started: its start time
                        (psutil create_time), which tells a reused pid apart
    start_method        forkserver | spawn (runtime.start_method resolved)
    forkserver_pid      the pre-imported server the actors fork from (their parent),
                        null under spawn; it dies with the supervisor
    forkserver_restarts times the server was lost and replaced (or given up for spawn)
    supervisor          {rss_mb, cpu_pct, and its GPU memory as an actor's below}
    stuck_after_s       an actor without a heartbeat this long is called stuck
    hang_timeout_s      ... and this long, killed and restarted
    actors              {actor id: {
        pid               null while it is down
        state             starting | idle | working | draining | exited | dead
        restarts          restarts so far in this supervisor's life
        heartbeat_age_s   seconds since its last beat (as of ``time``)
        progress          {done: work items this incarnation, wip: beats inside the current one}
        batch             the batch id in hand, or null
        holds             batch ids the dispatcher has given it
        busy_s            seconds spent in work; busy_pct_30s: of the last 30 s
        rss_mb, cpu_pct
        gpu_mem_mb        CUDA memory its caching allocator holds, MiB, on its current
                          device, as of its start-up, its last work item or its exit
                          (null: the process has not used CUDA)
        gpu_peak_mb       the peak it allocated there since it started (what the memory
                          plan, ``launch.py --plan-only``, predicts less the CUDA context)
        gpu_reserved_peak_mb  the peak its caching allocator held there
        phase             before Ready: {name, done, total, elapsed_s, idle_s}, else null
        stuck             why it looks stuck, or null}}
    rings               {ring name: {slots, used}}
    batches             {ledger state name: count, committed_this_run, total}
    training            (the job's) {step, total_steps, epoch, total_epochs, loss,
                        simulated_tau, lr, tokens, tokens_per_s (since all actors were
                        ready), tokens_per_s_30s, eta_s, skipped_steps}
    cluster             (the job's, over several machines) {nodes, rank, master,
                        steps_exchanged, exchange_ms_last, exchange_ms_mean,
                        replica_checks, failure, waiting_for: {nodes, s} or null}
    feature_cache       (the job's, with ``target.feature_cache`` on; ``FeatureCache.stats``)
                        {mode, samples_cached, samples, bytes, entries_present, batches,
                        forwards_skipped, samples_repeated, samples_served, misses,
                        first_batches_recomputed, samples_stored, samples_reused, hit_rate, forward_s,
                        forward_saved_s}
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from ..runtime.status import STATUS_FILE


class NoStatus(ValueError):
    """No readable status.json; the message is the one line to show."""


def read(run_dir: str | Path) -> dict:
    """The run's status; NoStatus naming what is wrong (no directory, no file yet, not
    a JSON object)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NoStatus(f"{run_dir}: no such directory")
    path = run_dir / STATUS_FILE
    if not path.exists():
        raise NoStatus(f"{run_dir} has no {STATUS_FILE}: not a run directory, or its job has not started yet")
    # The supervisor replaces the file atomically, so a bad read is not expected;
    # one retry covers a filesystem that does not honour that.
    for retry in (True, False):
        try:
            status = json.loads(path.read_text())
            if isinstance(status, dict):
                return status
            problem = "not a JSON object"
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            problem = str(e)
        if retry:
            time.sleep(0.2)
    raise NoStatus(f"{path} is unreadable: {problem}")


def read_or_none(run_dir: str | Path) -> Optional[dict]:
    """``read``, or None while there is nothing to read (a job starting or gone)."""
    try:
        return read(run_dir)
    except NoStatus:
        return None


class JobStatus:
    """The training job's ``on_status`` hook: its ``training`` block (``monitor``) and,
    across machines, its ``cluster`` block (``cluster.link``)."""

    def __init__(self, monitor, link=None):
        self.monitor, self.link = monitor, link

    def __call__(self, status: dict) -> None:
        status["training"] = self.monitor.update(status)
        if self.link is not None:
            status["cluster"] = self.link.status()
