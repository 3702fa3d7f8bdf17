"""The fork server started by ``launch.py`` as soon as the config is read, so that its
imports (torch, transformers, the actor modules: about 5 s of one core here) overlap
the supervisor's own imports and checks instead of following them.

Without it the supervisor starts its server only when the job begins, and the first
actors wait for its imports after everything else is done. Started early, it imports
on the second core while the launching process imports the same modules and runs the
preflight. It is a server, not an actor: nothing is forked from it until the checks
have passed, and bad input stops it (a kill: it has no children yet) before the exit
with status 2. Only this module knows the modules to load; a supervisor handed the
server logs any of its actors' modules that are missing (``not_preloaded`` in
``events.log``), which ``tests/integration/test_launch_path.py`` keeps empty.

Importing this module must stay cheap: ``launch.py`` imports it before torch.
"""

from __future__ import annotations

import os
from typing import Optional

from ..runtime import forking

PRELOAD = ("torch", "dflash_actors.actors.loader", "dflash_actors.actors.target", "dflash_actors.actors.drafter",
           "dflash_actors.actors.optimizer", "dflash_actors.models.target")
"""What the job's actors import (``Supervisor._start_forkserver`` names them from the stages)."""


class EarlyForkServer:
    """A fork server for this launch's job: started once the config says the job uses one
    (``start``), handed to the job (``server``), stopped when the launch ends (``stop``)."""

    def __init__(self):
        self.server: Optional[forking.ForkServerStarter] = None

    def start(self, cfg) -> None:
        if forking.resolve(cfg.runtime.start_method) != "forkserver":
            return
        self.server = forking.ForkServerStarter()
        self.server.start(list(PRELOAD), os.getpid())

    def stop(self) -> None:
        """Kill the server: by now it has no children (the job has stopped its actors, or
        none was forked), and one still importing would notice a closed pipe only later."""
        if self.server is not None:
            self.server.stop(wait_s=0.0)
            self.server = None
