"""The fork server's first import: it ties the server's life to the supervisor's.

With ``runtime.start_method: forkserver`` every actor is forked from one server process
(the standard library's ``multiprocessing.forkserver``) that imported torch,
transformers and the actor modules once, before it served any fork: a start or restart
then costs a fork instead of an interpreter and its imports. That server is the
supervisor's child and the actors are the server's. Imported first in the server's
preload list, this module arms the server's parent-death signal before the seconds
the other imports take, so a supervisor killed at any moment, the server's start-up
included, takes the server with it; and each actor's own signal (``boot``) is tied to
the server, so they go too.

It acts only where ``SUPERVISOR_PID_ENV`` is set, which the supervisor does for the
server's start alone: importing it anywhere else is harmless.
"""

from __future__ import annotations

import os

from .boot import die_with_parent

SUPERVISOR_PID_ENV = "DFLASH_ACTORS_FORKSERVER_PARENT"

if os.environ.get(SUPERVISOR_PID_ENV):
    die_with_parent(int(os.environ.pop(SUPERVISOR_PID_ENV)))
