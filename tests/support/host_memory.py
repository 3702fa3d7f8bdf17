"""A smaller host, as the memory plan sees it: on this machine's CPU the plan then picks
micro-batches for the drafters, as it does on a GPU that a whole batch does not fit.

The plan reads each device's memory through ``memplan.device_memory``; ``squeeze_host``
replaces it, for the test's process only, with one that reports the host as smaller.
Every plan made in that process (a job's preflight, the reference's) sees the same host,
and the job's actors get the config the plan resolved, so they need no patch."""

from __future__ import annotations

from dflash_actors.job.preflight import preflight
from dflash_actors.train import memplan


def host_plan(cfg) -> memplan.DevicePlan:
    """The host's part of ``cfg``'s memory plan on this process's host."""
    return next(d for d in preflight(cfg, progress=False).plan.devices if d.device == "cpu")


def squeeze_host(monkeypatch, cfg, share: float = 0.5) -> int:
    """Report the host's memory as bytes whose usable part (the plan's headroom kept out)
    is ``share`` of what ``cfg``'s plan needs there with whole batches; those bytes."""
    host = host_plan(cfg)
    assert host.fits and host.need < host.usable, "the whole batch must fit the real host"
    have = int(host.need * share * host.have / host.usable)
    real = memplan.device_memory

    def smaller(devices, gpu_memory_gib=None):
        out = real(devices, gpu_memory_gib)
        if out.get("cpu") is not None:
            out["cpu"] = have
        return out

    monkeypatch.setattr(memplan, "device_memory", smaller)
    return have
