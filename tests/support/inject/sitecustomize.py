"""Test-only fault injection for subprocess tests, outside the package.

A test puts this directory first on ``PYTHONPATH`` and sets one of the variables below;
every Python process of the run (the supervisor and each spawned actor) then imports
this file at start-up and patches the named module right after it is first imported:

* ``DFLASH_TEST_CHECKPOINT_PAUSE_S``: ``dflash_actors.train.checkpoint.save_checkpoint``
  stalls that many seconds after the drafter files are written and before the
  checkpoint is complete, so a kill can land mid-write.
* ``DFLASH_TEST_SHIFT_LAYERS``: ``TargetModel._run`` captures each configured layer's
  successor, a wrong layer mapping that only the target's self-check can see.
"""

import importlib.abc
import os
import sys
import time

PAUSE_ENV = "DFLASH_TEST_CHECKPOINT_PAUSE_S"
SHIFT_ENV = "DFLASH_TEST_SHIFT_LAYERS"


def _slow_down(module) -> None:
    pause = float(os.environ.get(PAUSE_ENV, 0))
    save = module.save_checkpoint

    def slow_save(run_dir, step, write_drafter, trainer_state):
        def write_then_stall(d):
            write_drafter(d)
            time.sleep(pause)
        return save(run_dir, step, write_then_stall, trainer_state)
    module.save_checkpoint = slow_save


def _shift_layers(module) -> None:
    run = module.TargetModel._run

    def shifted(self, input_ids, keep):
        ids = self.feature_ids
        self.feature_ids = [min(L + 1, self.num_layers - 1) for L in ids]
        try:
            return run(self, input_ids, keep)
        finally:
            self.feature_ids = ids
    module.TargetModel._run = shifted


PATCHES = {}
if float(os.environ.get(PAUSE_ENV, 0)) > 0:
    PATCHES["dflash_actors.train.checkpoint"] = _slow_down
if os.environ.get(SHIFT_ENV):
    PATCHES["dflash_actors.models.target"] = _shift_layers


class _Patch(importlib.abc.MetaPathFinder):
    """Finds a module of ``PATCHES`` with the other finders and patches it right after it runs."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader.exec_module = _then(spec.loader.exec_module, PATCHES[name])
                return spec
        return None


def _then(exec_module, patch):
    def run(module):
        exec_module(module)
        patch(module)
    return run


if PATCHES:
    sys.meta_path.insert(0, _Patch())
