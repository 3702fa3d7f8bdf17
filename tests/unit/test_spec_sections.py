"""Each actor's spec carries the config sections its stage reads (``Config.carrying``),
and no others: what a stage depends on is visible in its spec.

The oracle reads the source: every module an actor's module imports inside the package,
transitively, and every ``cfg.<section>`` in them. That is a superset of what a run
reads (a module's every function counts), so a stage that starts to read one more
section fails here before it can fail in a run, and a section no longer read leaves its
list. A read of the whole tree (``cfg.to_dict()``, ``cfg.digest()``, ``cfg.updated()``)
needs every section."""

import re
from pathlib import Path

import pytest

from dflash_actors.actors.drafter import DrafterSpec
from dflash_actors.actors.loader import LoaderSpec
from dflash_actors.actors.optimizer import OptimizerSpec
from dflash_actors.actors.target import TargetSpec
from dflash_actors.config import Config, load_config
from tests.unit.test_layers import PACKAGE, ROOT, imports

SECTIONS = {f for f in Config.__dataclass_fields__}
SPECS = {"loader": LoaderSpec, "target": TargetSpec, "drafter": DrafterSpec, "optimizer": OptimizerSpec}


def _path(module: str) -> Path | None:
    p = ROOT / Path(*module.split("."))
    return next((c for c in (p.with_suffix(".py"), p / "__init__.py") if c.is_file()), None)


def closure(module: str) -> set[Path]:
    """The files of ``module`` and of every package module it imports, transitively."""
    seen: set[Path] = set()
    todo = [module]
    while todo:
        path = _path(todo.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        todo += [name for _, name, _ in imports(path)]
    return seen


def sections_read(module: str) -> set[str]:
    read: set[str] = set()
    for path in closure(module) - set((PACKAGE / "config").glob("*.py")):    # the config's own methods
        text = path.read_text()
        if re.search(r"\bcfg\.(to_dict|digest|updated)\(", text):
            return set(SECTIONS)
        read |= set(re.findall(r"\bcfg\.(\w+)\b", text)) & SECTIONS
    return read


@pytest.mark.parametrize("stage", SPECS)
def test_each_spec_carries_the_sections_its_stage_reads(stage):
    assert set(SPECS[stage].SECTIONS) == sections_read(f"dflash_actors.actors.{stage}")


def test_the_oracle_sees_through_imports():
    # The loader's module names only data.*; the schedule it imports reads train and topology.
    assert {"train", "topology"} <= sections_read("dflash_actors.actors.loader")
    assert not re.search(r"cfg\.(train|topology)\b", (PACKAGE / "actors" / "loader.py").read_text())


def test_a_withheld_section_names_the_holder_and_survives_pickling():
    import pickle

    cfg = load_config(None).carrying(("data", "train"), "loader's spec")
    assert cfg.train.seed == load_config(None).train.seed
    again = pickle.loads(pickle.dumps(cfg))
    with pytest.raises(AttributeError, match=r"loader's spec does not carry config section 'eval' \(read eval.every\)"):
        print(again.eval.every)
    assert not hasattr(again.eval, "__deepcopy__")
    with pytest.raises(ValueError, match="no config sections"):
        load_config(None).carrying(("trian",), "x")
