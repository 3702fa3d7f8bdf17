"""The first code an actor process runs: tie its life to the supervisor's, then load.

With the spawn start method a child unpickles its target's arguments before it runs
any code of ours, and an actor's arguments hold torch tensors and the actor's class,
whose imports (torch, transformers) take seconds. A supervisor killed with SIGKILL in
that window used to leave its children alive until they had finished starting (10 to
30 s). So the process target is ``boot``, in this module, which needs only the standard
library: the real arguments travel as bytes (``Deferred``), pickled while the process
object is, so the descriptors of shared tensors and pipes still pass to the child; the
child unpickles them only once the parent-death signal is armed.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
from multiprocessing.reduction import ForkingPickler

PR_SET_PDEATHSIG = 1


class Deferred:
    """Pickles ``obj`` into bytes at the moment it is itself pickled: inside
    ``Process.start``, where fd-backed objects register their descriptors for the child.
    The child receives plain bytes and decides when to load them."""

    def __init__(self, obj):
        self.obj = obj

    def __reduce__(self):
        return bytes, (bytes(ForkingPickler.dumps(self.obj)),)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the supervisor dies. The signal is tied to the thread
    that forked us (the supervisor spawns from its main thread); the getppid check
    closes the race of a parent that died before prctl ran."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def _check_fork_is_cuda_safe() -> None:
    """A process forked (from the fork server) after CUDA was initialised there cannot
    use CUDA at all; say so plainly instead of failing later, deep in a model's first
    kernel. (Spawned children have not imported torch yet: nothing to check.)"""
    torch = sys.modules.get("torch")
    in_bad_fork = getattr(getattr(torch, "cuda", None), "_is_in_bad_fork", None)
    if in_bad_fork is not None and in_bad_fork():
        raise RuntimeError("this actor was forked from a process that had initialised CUDA; "
                           "use runtime.start_method=spawn, or keep CUDA out of module imports")


def boot(parent_pid: int, payload: bytes, entry: str = "dflash_actors.runtime.actor:actor_main") -> None:
    """Process target: arm the parent-death signal, then load ``payload`` (the pickled
    argument tuple) and call ``entry`` (``module:function``) with it."""
    die_with_parent(parent_pid)
    _check_fork_is_cuda_safe()
    args = pickle.loads(payload)
    module, _, name = entry.partition(":")
    fn = getattr(__import__(module, fromlist=[name]), name)
    fn(*args)
