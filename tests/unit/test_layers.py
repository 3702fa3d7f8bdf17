"""The package's folders are layers, and imports only run down them.

    tools -> job -> {eval, actors, observe} -> prepare -> train -> models
          -> {data, cluster} -> config -> console -> runtime

Operator tools on top, then the run, then its processes and what watches them, then the
training data's regeneration, then shared state and math, then models and data, then the
config and the terminal, then the generic runtime. A module may import its own folder
and any lower layer, never a higher one nor a sibling on its own layer (the evaluator
does not import the actors, the monitor or the job). Lazy imports inside functions count
too. Inside the package every import is relative (one module, one name).
``test_runtime_generic`` keeps the bottom layer free of DFlash altogether.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dflash_actors"
LAYERS = (("tools",), ("job",), ("eval", "actors", "observe"), ("prepare",), ("train",), ("models",),
          ("data", "cluster"), ("config",), ("console",), ("runtime",))
RANK = {group: depth for depth, groups in enumerate(LAYERS) for group in groups}


def _group(module: str) -> str | None:
    """``dflash_actors.train.optim`` -> ``train``; ``dflash_actors.config`` -> ``config``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "dflash_actors" else None


def _module(path: Path, base: Path) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, base: Path = ROOT) -> list[tuple[int, str, int]]:
    """``(line, absolute module, level)`` of every import of the package in ``path``."""
    mod = _module(path, base)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
            out += [(node.lineno, n, node.level) for n in names if n.startswith("dflash_actors")]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, 0) for a in node.names if a.name.startswith("dflash_actors")]
    return out


def violations(package: Path = PACKAGE) -> list[str]:
    """One line per import against the rules (module docstring)."""
    base, bad = package.parent, []
    for path in sorted(package.rglob("*.py")):
        mine = _group(_module(path, base))
        if mine is None:
            continue
        for line, target, level in imports(path, base):
            where = f"{path.relative_to(base)}:{line} imports {target}"
            if level == 0:
                bad.append(f"{where}: absolute inside the package (write it relative)")
            theirs = _group(target)
            if theirs is None or theirs == mine:
                continue
            if theirs not in RANK or mine not in RANK:
                bad.append(f"{where}: {theirs if theirs not in RANK else mine} is in no layer")
            elif RANK[theirs] < RANK[mine]:
                bad.append(f"{where}: {mine}/ is below {theirs}/")
            elif RANK[theirs] == RANK[mine]:
                bad.append(f"{where}: {mine}/ and {theirs}/ are siblings")
    return bad


def test_every_folder_is_in_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert folders | modules == set(RANK), "LAYERS must name every folder and top-level module"


def test_imports_run_only_down_the_layers():
    assert violations() == []


@pytest.mark.parametrize("where, line, rule", [
    ("data/batching.py", "from ..models.drafter import build_drafter", "data/ is below models/"),
    ("config/__init__.py", "from ..train.schedule import Schedule", "config/ is below train/"),
    ("eval/tau.py", "from ..job.preflight import preflight", "eval/ is below job/"),
    ("train/optim.py", "from ..tools import chaos", "train/ is below tools/"),
    ("eval/decode.py", "from ..observe.monitor import Monitor", "eval/ and observe/ are siblings"),
    ("runtime/ledger.py", "from dflash_actors.runtime import channels", "absolute inside the package"),
])
def test_the_rules_catch_an_import_that_runs_up(tmp_path, where, line, rule):
    """The check itself: the package copied, one import added against the rules."""
    import shutil
    copy = tmp_path / "dflash_actors"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "prompts"))
    target = copy / where
    target.write_text(target.read_text() + f"\n{line}\n")
    found = violations(copy)
    assert len(found) == 1 and rule in found[0] and where in found[0], found


def test_importing_a_layer_loads_nothing_above_it():
    """What the import system actually pulls in, in a fresh interpreter: the config and
    the data never load the models, the trainer or the job."""
    code = ("import json, sys\nimport dflash_actors.config, dflash_actors.data.dataset, dflash_actors.data.batching\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('dflash_actors.'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = {_group(m) for m in json.loads(out.stdout)}
    assert loaded <= {"config", "console", "runtime", "data"}, loaded


def test_launch_py_imports_no_torch_at_the_top():
    """Every actor re-imports ``launch.py`` as its ``__mp_main__`` (the spawn start
    method) before its first own code arms the parent-death signal, so whatever
    ``launch.py`` imports at the top is a window in which a killed supervisor leaves
    orphans: it must stay at the config and the console, never torch."""
    code = "import json, sys\nimport launch\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    heavy = [m for m in json.loads(out.stdout) if m.split(".")[0] in ("torch", "transformers", "numpy")]
    assert not heavy, f"import launch loads {sorted({m.split('.')[0] for m in heavy})}"


def test_every_folder_names_each_of_its_modules():
    """A folder's ``__init__`` is its door: it says what each of its modules holds, so a
    module added without a word there is a room nobody will find."""
    import ast
    import re

    missing = []
    for init in sorted((ROOT / "dflash_actors").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for module in sorted(init.parent.glob("*.py")):
            if module.stem != "__init__" and not re.search(rf"\b{module.stem}\b", doc):
                missing.append(f"{init.parent.name}/{module.name}")
    assert not missing, f"not named in their folder's __init__ docstring: {missing}"


def test_no_module_imports_itself_back_through_another():
    """Within a folder too, imports form no circle (one kept alive by imports inside
    functions is still a circle: the two modules are one room)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        mod = _module(path, ROOT)
        graph[mod] = {t for _, t, _ in imports(path) if t != mod}
    names = set(graph)

    def resolved(target: str) -> str | None:      # "pkg.mod.name" imports resolve to "pkg.mod"
        while target and target not in names:
            target = target.rpartition(".")[0]
        return target or None
    edges = {m: {r for t in ts if (r := resolved(t)) and r != m and not m.startswith(r + ".")}
             for m, ts in graph.items()}
    circles = []

    def visit(m, path, seen):
        for n in edges[m]:
            if n == path[0]:
                circles.append(" -> ".join(path + [n]))
            elif n not in seen and n > path[0]:
                seen.add(n)
                visit(n, path + [n], seen)
    for m in sorted(edges):
        visit(m, [m], {m})
    assert not circles, circles
