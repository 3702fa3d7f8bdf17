"""Test-only fault injection for subprocess tests, outside the package.

A test puts this directory first on ``PYTHONPATH`` and sets
``DFLASH_TEST_CHECKPOINT_PAUSE_S``; every Python process of the run (the supervisor and
each spawned actor) then imports this file at start-up, and once
``dflash_actors.checkpoint`` is imported its ``save_checkpoint`` stalls that many
seconds after the drafter files are written and before the checkpoint is complete, so
a kill can land mid-write.
"""

import importlib.abc
import os
import sys
import time

PAUSE_ENV = "DFLASH_TEST_CHECKPOINT_PAUSE_S"
MODULE = "dflash_actors.checkpoint"


def _slow_down(module) -> None:
    pause = float(os.environ.get(PAUSE_ENV, 0))
    save = module.save_checkpoint

    def slow_save(run_dir, step, write_drafter, trainer_state):
        def write_then_stall(d):
            write_drafter(d)
            time.sleep(pause)
        return save(run_dir, step, write_then_stall, trainer_state)
    module.save_checkpoint = slow_save


class _Patch(importlib.abc.MetaPathFinder):
    """Finds ``MODULE`` with the other finders and patches it right after it runs."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader.exec_module = _then_slow_down(spec.loader.exec_module)
                return spec
        return None


def _then_slow_down(exec_module):
    def run(module):
        exec_module(module)
        _slow_down(module)
    return run


if float(os.environ.get(PAUSE_ENV, 0)) > 0:
    sys.meta_path.insert(0, _Patch())
