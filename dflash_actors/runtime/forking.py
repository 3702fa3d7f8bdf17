"""How actor processes start: a fresh interpreter each (spawn), or a fork of one server
process that has imported everything once (forkserver, the default where it exists).

The standard library has one fork server per process, started on first use with the
preload list set before it, and shared by everything in that process. A supervisor
needs its own: two supervisors can run in one process (the two-node tests run one per
thread), each must stop its server when it ends (a server left running would outlive
the job), and the server's parent-death signal (``forker``) is tied to the thread that
started it. So ``ForkServerStarter`` keeps a private ``multiprocessing.forkserver``
server and a ``Process`` class that forks from it; the server itself is the stdlib's
(its ``main``, and its protocol for handing a child its arguments and descriptors).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing import forkserver, popen_forkserver, process, reduction, spawn, util
from multiprocessing.context import set_spawning_popen
from typing import Optional

from .forker import SUPERVISOR_PID_ENV

STOP_WAIT_S = 2.0
"""After closing its pipe, how long the server has to exit before it is killed."""


def resolve(configured: str) -> str:
    """``runtime.start_method`` resolved: auto is forkserver where the platform has it."""
    if configured == "auto":
        return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    return configured


class _Popen(popen_forkserver.Popen):
    """The stdlib's forkserver Popen, asking a given server instead of the process-wide one."""

    def __init__(self, process_obj, server: forkserver.ForkServer):
        self._server = server
        super().__init__(process_obj)

    def _launch(self, process_obj):
        # As the stdlib does it: pickle the preparation data and the process object
        # with this Popen as the spawning one (descriptors are collected into
        # self._fds), hand the descriptors to the server, which forks, then stream the
        # pickles to the child; the first int back is its pid.
        prep = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = self._server.connect_to_new_process(self._fds)
        keep_w = os.dup(w)     # the child's view of its parent: alive while we hold it
        self.finalizer = util.Finalize(self, util.close_fds, (keep_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


_SERVERS: dict[int, forkserver.ForkServer] = {}
"""The live private servers of this process, by key (a process object carries only
the key: it is pickled for its child, and a server is not picklable)."""


class ServerProcess(process.BaseProcess):
    """A process forked from the private server named by its ``_server_key``."""

    _start_method = "forkserver"
    _server_key = -1

    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj, _SERVERS[process_obj._server_key])


class ForkServerStarter:
    """A private fork server, and ``Process`` objects that fork from it."""

    def __init__(self):
        self._server = forkserver.ForkServer()
        self._key = id(self._server)
        self.preload: tuple[str, ...] = ()
        """What the server imports before it serves a fork, ``forker`` first."""

    def Process(self, **kwargs) -> ServerProcess:
        proc = ServerProcess(**kwargs)
        proc._server_key = self._key
        return proc

    def start(self, modules: list[str], supervisor_pid: int) -> int:
        """Start the server with ``forker`` and then ``modules`` imported before it serves
        the first fork (that fork's ``Process.start`` returns at once; the child waits
        for the imports); its pid. ``forker`` learns whom to die with from the
        environment, set for this start only; so does the server's ``sys.path``:
        ``PYTHONPATH``, then ours, as spawn gives a child (the stdlib's server does not
        apply the path it is handed before its imports, and a failed preload import is
        silently skipped)."""
        _SERVERS[self._key] = self._server
        self.preload = tuple(dict.fromkeys([f"{__package__}.forker", *modules]))
        self._server.set_forkserver_preload(list(self.preload))
        saved = {k: os.environ.get(k) for k in (SUPERVISOR_PID_ENV, "PYTHONPATH")}
        os.environ[SUPERVISOR_PID_ENV] = str(supervisor_pid)
        os.environ["PYTHONPATH"] = os.pathsep.join([*filter(None, [saved["PYTHONPATH"]]), *filter(None, sys.path)])
        try:
            self._server.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return self._server._forkserver_pid

    @property
    def pid(self) -> Optional[int]:
        return getattr(self._server, "_forkserver_pid", None)

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Close the server's pipe, which tells it to exit; kill it if it has not within
        ``wait_s`` (its children are gone by now: the supervisor stops its actors first).
        A server still importing notices the pipe only once its imports are done."""
        pid = self.pid
        if pid is None:
            return
        os.close(self._server._forkserver_alive_fd)
        end = time.monotonic() + wait_s
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > end:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
        address = self._server._forkserver_address
        if address and not util.is_abstract_socket_namespace(address):
            try:
                os.unlink(address)
            except OSError:
                pass
        self._server._forkserver_pid = self._server._forkserver_alive_fd = self._server._forkserver_address = None
        _SERVERS.pop(self._key, None)
