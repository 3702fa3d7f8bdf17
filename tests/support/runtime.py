"""Helpers for the runtime tests (toy actors in real processes): configs, event logs,
and a thread that watches the live heartbeat table to strike (kill -9, SIGSTOP) actors
while they hold a batch."""

import json
import os
import signal
import threading
import time
from pathlib import Path

from dflash_actors.runtime.actor import Phase
from dflash_actors.runtime.config import RuntimeConfig, build
from dflash_actors.runtime.ledger import Col
from tests.support.toy import S, checksum

ROOT = Path(__file__).resolve().parents[2]


def runtime(tmp_path, **kw) -> RuntimeConfig:
    raw = {"run_dir": str(tmp_path / "run"), "heartbeat_s": 0.2, "hang_timeout_s": 60.0,
           "start_timeout_s": 120.0, "grace_s": 10.0, **kw}
    return build(RuntimeConfig, raw, "runtime.")


def events(run_dir, kind=None) -> list[dict]:
    lines = (Path(run_dir) / "events.log").read_text().splitlines()
    evs = [json.loads(x) for x in lines]
    return [e for e in evs if kind is None or e["event"] == kind]


def assert_exactly_once(sup, results, result, n, token_budget=256, max_rows=8):
    """Every batch committed once, with its payload intact end to end."""
    assert sorted(result.committed) == list(range(n)), "a batch is missing or repeated"
    assert (sup.ledger.table[:, Col.STATE] == S.COMMITTED).all()
    assert (sup.ledger.table[:, Col.OWNER] == -1).all()
    got = results.tolist()
    bad = [b for b in range(n) if got[b] != checksum(b, token_budget, max_rows)]
    assert not bad, f"payload wrong for batches {bad[:10]}"
    assert all(r["used"] == 0 for r in sup.dispatcher.occupancy().values()), "a slot leaked"


class Striker(threading.Thread):
    """Sends ``sig`` to each actor id in ``plan`` in turn, while it is working on a
    batch, then waits for its replacement to be ready before the next strike."""

    def __init__(self, sup, plan, sig=signal.SIGKILL, wait_replacement=True, timeout=90.0):
        super().__init__(daemon=True)
        self.sup, self.plan, self.sig = sup, plan, sig
        self.wait_replacement, self.timeout = wait_replacement, timeout
        self.strikes: list[dict] = []   # actor, pid, batch, mono
        self.error = None

    def _row(self, actor_id):
        c = next(c for c in self.sup.children if c.actor_id == actor_id)
        return c, self.sup.heartbeats.row(c.number)

    def _until(self, cond):
        end = time.monotonic() + self.timeout
        while time.monotonic() < end:
            if self.sup.dispatcher.finished():
                return None
            r = cond()
            if r:
                return r
            time.sleep(0.002)
        raise TimeoutError("striker waited too long")

    def _batch_at_death(self, actor_id, pid):
        """The batch the killed process held when it died (-1: idle), from its own
        heartbeat row. The batch read before the kill can be stale: in the instant
        between that read and the signal, the actor may finish it and take the next.
        None if the successor overwrote the row before it could be read."""
        end = time.monotonic() + self.timeout
        while not all_gone([pid], 0.0) and time.monotonic() < end:
            time.sleep(0.0005)   # a forked successor can be up within tens of ms
        row = self._row(actor_id)[1]
        return row["batch"] if row["pid"] == pid else None

    def run(self):
        try:
            for actor_id in self.plan:
                def working(actor_id=actor_id):
                    c, hb = self._row(actor_id)
                    proc = c.proc
                    if proc is not None and c.ready and hb["pid"] == proc.pid and hb["phase"] == Phase.WORKING:
                        return hb
                while True:
                    hb = self._until(working)
                    if hb is None:
                        return
                    try:
                        os.kill(hb["pid"], self.sig)
                        break
                    except ProcessLookupError:
                        # Dead already (an earlier strike) and reaped by the fork server it
                        # came from, before the supervisor noticed: wait for its successor.
                        time.sleep(0.01)
                strike = {"actor": actor_id, "pid": hb["pid"], "batch": hb["batch"], "mono": time.monotonic()}
                if self.sig == signal.SIGKILL:
                    strike["at_death"] = self._batch_at_death(actor_id, hb["pid"])
                self.strikes.append(strike)
                if self.wait_replacement:
                    def replaced(actor_id=actor_id, old=hb["pid"]):
                        c, row = self._row(actor_id)
                        return c.ready and row["pid"] not in (0, old)
                    if self._until(replaced) is None:
                        return
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e


def all_gone(pids, within_s: float) -> bool:
    """True once every pid has exited (a zombie counts: it runs nothing), waiting up to ``within_s``."""
    import psutil

    def gone(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    end = time.monotonic() + within_s
    while not all(gone(p) for p in pids):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def wait_for(cond, what: str, timeout: float = 90.0, poll_s: float = 0.01):
    """``cond()``'s first truthy value, polled every ``poll_s``; TimeoutError naming ``what``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = cond()
        if r:
            return r
        time.sleep(poll_s)
    raise TimeoutError(what)
