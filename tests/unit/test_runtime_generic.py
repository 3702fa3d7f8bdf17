"""``dflash_actors.runtime`` stays generic: it could run any staged pipeline, so it
imports nothing of DFlash (no models, batching, schedule, or project config) and no
model library."""

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "dflash_actors" / "runtime"
FORBIDDEN_LIBS = ("transformers", "safetensors", "pyarrow")


def _modules() -> list[str]:
    return sorted(f"dflash_actors.runtime.{p.stem}" for p in RUNTIME.glob("*.py") if p.stem != "__init__")


def test_runtime_sources_import_only_the_runtime():
    bad = []
    for path in sorted(RUNTIME.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                # Relative imports must stay inside the package (level 1: ``from .x``).
                if node.level > 1 or (node.level == 0 and (node.module or "").startswith("dflash_actors")
                                      and not node.module.startswith("dflash_actors.runtime")):
                    bad.append(f"{path.name}:{node.lineno} from {'.' * node.level}{node.module}")
            elif isinstance(node, ast.Import):
                bad += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                        if a.name.startswith("dflash_actors") and not a.name.startswith("dflash_actors.runtime")]
    assert not bad, f"the runtime imports outside itself: {bad}"


def test_importing_the_runtime_loads_nothing_of_dflash():
    # A fresh interpreter: what importing every runtime module actually pulls in.
    code = ("import importlib, json, sys\n"
            f"for m in {_modules()!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    ours = [m for m in loaded if m.startswith("dflash_actors") and m != "dflash_actors"
            and not m.startswith("dflash_actors.runtime")]
    libs = [m for m in loaded if m.split(".")[0] in FORBIDDEN_LIBS]
    assert not ours and not libs, f"the runtime loaded {ours + sorted({m.split('.')[0] for m in libs})}"
    assert len(_modules()) >= 8 and all(m in loaded for m in _modules())
