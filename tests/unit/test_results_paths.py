"""No committed result names the machine that measured it: not one absolute path in
``benchmarks/results/`` (``harness.ABSOLUTE_PATH`` is the rule), and the harness every
benchmark prints and writes through cannot put one there."""

import json
import tempfile
from pathlib import Path

import pytest

from benchmarks import harness

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def text_files() -> list[Path]:
    """Every committed result a person or a script reads as text (figures are left out)."""
    out = []
    for p in sorted(RESULTS.iterdir()):
        data = p.read_bytes() if p.is_file() else b"\0"
        if b"\0" not in data:
            out.append(p)
    return out


def absolute_paths(text: str) -> list[str]:
    return [f"line {n}: {m.group(0)}" for n, line in enumerate(text.splitlines(), 1)
            for m in harness.ABSOLUTE_PATH.finditer(line)]


def test_there_are_results_to_check():
    names = {p.suffix for p in text_files()}
    assert {".json", ".jsonl", ".md"} <= names


@pytest.mark.parametrize("path", text_files(), ids=lambda p: p.name)
def test_no_committed_result_holds_an_absolute_path(path):
    assert absolute_paths(path.read_text(errors="replace")) == [], \
        f"{path.name} names paths of the machine that wrote it: rewrite them relative (benchmarks.harness.portable)"


def machine_paths() -> list[str]:
    """Absolute paths of this machine, built here, so that this file names none itself."""
    return [str(Path.cwd() / ".cache" / "smollm2-train"), str(Path(tempfile.gettempdir()) / "chaos-x1" / "2-2.log"),
            str(Path.home() / "runs" / "a"), str(Path("/").joinpath("models", "Qwen3-8B")),
            str(Path("/").joinpath("usr", "lib", "python3", "site-packages", "vllm", "config.py"))]


@pytest.mark.parametrize("path", machine_paths())
def test_the_rule_finds_a_path_anywhere_in_a_text(path):
    for text in (path, f"see {path}/x.log", f'{{"data": "{path}"}}', f"--run-dir={path}", f"({path}:12)",
                 f"File '{path}', line 3"):
        assert absolute_paths(text), text


@pytest.mark.parametrize("text", ["tokens/s", "GB/batch feat/grad/weights", "1/2 of 3/4", "a / b", "./run",
                                  "~/runs/x", "$TMPDIR/chaos", ".../models/Qwen3-8B", "https://ui.perfetto.dev/x/y",
                                  "http://127.0.0.1:8000/v1/completions", "runs/bench-real-20261207/checkpoints",
                                  "load/target/draft/opt-step"])
def test_the_rule_leaves_what_is_not_an_absolute_path(text):
    assert absolute_paths(text) == []


def test_emit_prints_and_writes_no_absolute_path(tmp_path, capsys):
    record = {"bench": "x", "paths": machine_paths(), Path.cwd().as_posix() + "/k": 1,
              "cmd": " ".join(["launch.py", "--run-dir", machine_paths()[1], "--out", str(Path.cwd())])}
    saved = tmp_path / "x.json"
    printed = harness.emit(record, saved)
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and json.loads(line) == printed == json.loads(saved.read_text())
    assert absolute_paths(line) == []
    assert printed["paths"][:3] == [".cache/smollm2-train", "$TMPDIR/chaos-x1/2-2.log", "~/runs/a"]
    assert printed["paths"][3:] == [".../models/Qwen3-8B", "vllm/config.py"]
    assert printed["cmd"] == "launch.py --run-dir $TMPDIR/chaos-x1/2-2.log --out ."
    assert printed["bench"] == "x" and set(harness.STAMP) <= set(printed)
    assert list(printed)[0] == "bench"


def test_write_result_writes_the_table_without_absolute_paths(tmp_path):
    stem = tmp_path / "2026-12-07-recipe-minutes-12.5"
    harness.write_result(stem, {"data": machine_paths()[0]}, f"| data | {machine_paths()[0]} |")
    assert json.loads((tmp_path / f"{stem.name}.json").read_text()) == {"data": ".cache/smollm2-train"}
    assert (tmp_path / f"{stem.name}.md").read_text() == "| data | .cache/smollm2-train |\n"
