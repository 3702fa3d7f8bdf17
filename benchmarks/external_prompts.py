"""Build ``dflash_actors/prompts/external.jsonl``: chat prompts that somebody else wrote.

    pip download --no-deps bfcl-eval==2026.3.23 -d /tmp/bfcl
    python -m benchmarks.external_prompts /tmp/bfcl/bfcl_eval-2026.3.23-py3-none-any.whl

The project's own prompt sets (``train.jsonl``, ``heldout.jsonl``) were written by one hand, in one
style; a drafter can look better on held-out prompts of that style than on requests it meets in
service. The Berkeley Function Calling Leaderboard (Apache-2.0) ships, in its PyPI wheel, questions
that its tools cannot answer (``BFCL_v4_irrelevance``: written by its authors) and questions that
its users sent (``BFCL_v4_live_irrelevance``). Without the tool list they are ordinary chat
requests. This script takes a seeded sample of the single-turn, user-only, ASCII ones of 20 to
300 characters, half from each file, and writes them in the project's prompt format. It is run
once by hand; the file it writes is committed, so the benchmark needs no download.
"""
from __future__ import annotations

import json
import random
import zipfile
from pathlib import Path

from benchmarks import harness

SOURCES = ("bfcl_eval/data/BFCL_v4_irrelevance.json", "bfcl_eval/data/BFCL_v4_live_irrelevance.json")
OUT = Path(__file__).resolve().parent.parent / "dflash_actors" / "prompts" / "external.jsonl"


def usable(turns) -> str | None:
    """The user text of a single-turn, user-only question that reads as a chat request, else None."""
    if len(turns) != 1 or len(turns[0]) != 1 or turns[0][0]["role"] != "user":
        return None
    text = " ".join(turns[0][0]["content"].split())
    return text if 20 <= len(text) <= 300 and text.isascii() else None


def main(argv=None):
    ap = harness.parser(__doc__)
    ap.add_argument("wheel", help="the bfcl-eval wheel (pip download --no-deps bfcl-eval)")
    ap.add_argument("--per-source", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    own = {json.loads(line)["messages"][-1]["content"] for name in ("train.jsonl", "heldout.jsonl")
           for line in (OUT.parent / name).open()}
    picked: list[str] = []
    with zipfile.ZipFile(args.wheel) as wheel:
        for source in SOURCES:
            rows = [json.loads(line) for line in wheel.read(source).decode().splitlines() if line.strip()]
            texts = sorted({t for r in rows if (t := usable(r["question"])) and t not in own and t not in picked})
            picked += random.Random(args.seed).sample(texts, args.per_source)
    random.Random(args.seed).shuffle(picked)
    write_prompts(args.out, picked)
    harness.emit({"bench": "external_prompts", "out": args.out, "prompts": len(picked), "sources": SOURCES}, args.save)


def write_prompts(path, texts: list[str]) -> None:
    """``texts`` as the project's prompt format: one user message a line."""
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")


if __name__ == "__main__":
    main()
