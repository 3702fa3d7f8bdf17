"""One fork server for the test session's in-process jobs.

A job that starts its own fork server waits about 5 s (one core) for its imports
before its first actor forks; the suite runs dozens of jobs. Those that run in this
process and do not care which server they fork from (``tests.support.pipeline.job``,
``tests.support.toy.toy_job``) share this one instead, as ``launch.py``'s job shares the
server it started early: the caller owns it, each job's supervisor only forks from it
(and replaces it if a test kills it, ``runtime.group``). Tests of the server itself, of
what a job's own server does, or of an environment the actors must inherit, keep their
own.

The server runs with its own leak-check token (``leakcheck``): what it forks carries
that token, not a test's, so after each test ``leakcheck`` also looks for anything left
of the server's children.
"""

from __future__ import annotations

import os
import uuid
from typing import Optional

from dflash_actors.job.forkserver import PRELOAD
from dflash_actors.runtime.forking import ForkServerStarter

from .leakcheck import TOKEN_VAR

TOKEN = f"shared-fork-server-{uuid.uuid4().hex}"
"""The leak-check token of the server and everything forked from it."""

TOY = "tests.support.toy"
"""The toy actors' module, imported once in the server as a job's own server imports
its stages' modules: an actor that imported it at each start would start late."""

_server: Optional[ForkServerStarter] = None


def get() -> ForkServerStarter:
    """The session's server, started on first use (a job replaces a dead one)."""
    global _server
    if _server is None:
        saved = os.environ.get(TOKEN_VAR)
        os.environ[TOKEN_VAR] = TOKEN   # the server's environment is the one it starts with
        try:
            server = ForkServerStarter()
            server.start([*PRELOAD, TOY], os.getpid())
        finally:
            if saved is None:
                os.environ.pop(TOKEN_VAR)
            else:
                os.environ[TOKEN_VAR] = saved
        _server = server
    return _server


def pid() -> Optional[int]:
    """The server's pid, if it was started (None: no test has used it yet)."""
    return _server.pid if _server is not None else None


def stop() -> None:
    global _server
    if _server is not None:
        _server.stop()
        _server = None
