"""The peers' own code, pinned, fetched once and imported unmodified: what parity is checked against.

    python -m benchmarks.peers          # make peers: fetch what is missing, write the manifest

``PINS`` is the one place that says which release of each peer the checks run against:
its version and the sha256 of its wheel. ``fetch`` puts each pinned wheel in
``.cache/peers`` with ``pip download --no-deps`` (a wheel already there with the pinned
hash is kept, so a second run downloads nothing) and writes ``peers.json`` beside it: per
peer the version, wheel file and sha256, or why it is missing. A wheel that cannot be
fetched (no network, no such file) or that arrives with another hash is recorded as
missing rather than failing the command, so that a check without its peer skips and says
why.

``peer(name)`` is how a check gets one: the recorded wheel, its hash checked against the
pin, or ``PeerUnavailable`` with the manifest's reason (the only reason a parity test may
skip). ``importing(peer, stubs=...)`` imports from the wheel's files, extracted once into
``.cache/peers/<name>-<version>/`` (``extracted``: on every use each file is compared with
the checked wheel's bytes, so what runs is what the hash covers; extracted rather than
imported through ``zipimport`` because peers and transformers read their own source files,
e.g. to save a config class beside a checkpoint). A peer that imports a package this
environment lacks may name it in ``stubs``; only names that do not import are stubbed, only
while the import runs, and ``Imported.stubbed`` lists them so a result can say so.
``record`` is what a result writes: name, version, sha256.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import harness

CACHE = harness.ROOT / ".cache" / "peers"
MANIFEST = "peers.json"


@dataclass(frozen=True)
class Pin:
    version: str
    sha256: str
    """Of the wheel PyPI serves for this version: a fetched file that differs is refused."""


PINS = {
    "nemo-automodel": Pin("0.7.0", "37b8397a73c17e4a8bffd0cd3becc0507abecc1ebfea3b3eb6468eed57ba6674"),
    "specforge": Pin("0.2.0", "fbc79517adf483c6a8beea52561b1a8c8c8a99a54c820b47d2033a73966b55b0"),
    "dflash": Pin("0.1.0", "b3fe38d9413efc30a952c8b38b34f1dcc696ba6d7b865acbf540a34cc53afaa2"),
    "speculators": Pin("0.9.0", "f0de7571274ce996d769ce81240379728dcb38701f77d2d34cfd0d670d1b4481"),
}


class PeerUnavailable(Exception):
    """The peer's wheel is not in the cache; the message says why (a check skips with it)."""


@dataclass(frozen=True)
class Peer:
    name: str
    version: str
    wheel: Path
    sha256: str

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"

    @property
    def root(self) -> Path:
        return self.wheel.parent / f"{self.name}-{self.version}"

    def record(self) -> dict:
        return {"peer": self.label, "wheel": self.wheel.name, "sha256": self.sha256}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_prefix(name: str, version: str) -> str:
    """The start of the wheel's file name (PEP 427 escapes ``-`` in the project name)."""
    return f"{name.replace('-', '_').lower()}-{version}-"


def _find_wheel(dest: Path, name: str, version: str) -> Path | None:
    found = sorted(dest.glob(wheel_prefix(name, version) + "*.whl"))
    return found[0] if found else None


def pip_download(name: str, version: str, dest: Path) -> str | None:
    """``pip download`` of one wheel into ``dest``; ``None``, or pip's last words when it fails."""
    out = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                          "-d", str(dest), f"{name}=={version}"], capture_output=True, text=True)
    if out.returncode == 0:
        return None
    lines = [x for x in (out.stderr or out.stdout).splitlines() if x.strip() and not x.startswith("WARNING")]
    return lines[-1].strip() if lines else f"pip exited {out.returncode}"


def fetch(dest: Path = CACHE, pins: dict[str, Pin] = PINS,
          download: Callable[[str, str, Path], str | None] = pip_download) -> dict:
    """Each pinned wheel in ``dest`` (downloaded only when absent or not the pinned
    bytes); the manifest, also written to ``dest/peers.json``."""
    dest.mkdir(parents=True, exist_ok=True)
    peers = {}
    for name, pin in pins.items():
        entry = {"version": pin.version}
        wheel = _find_wheel(dest, name, pin.version)
        if wheel is not None and sha256(wheel) != pin.sha256:
            wheel.unlink()           # not the pinned bytes (a partial or another build): fetch again
            wheel = None
        if wheel is None:
            error = download(name, pin.version, dest)
            wheel = _find_wheel(dest, name, pin.version)
            if wheel is None:
                entry["missing"] = f"pip download {name}=={pin.version} failed: {error or 'no wheel'}"
        if wheel is not None:
            digest = sha256(wheel)
            if digest == pin.sha256:
                entry.update(wheel=wheel.name, sha256=digest)
            else:
                wheel.unlink()
                entry["missing"] = f"{wheel.name} has sha256 {digest}, the pin says {pin.sha256}"
        peers[name] = entry
    manifest = {"peers": peers}
    harness.write_text(dest / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def peer(name: str, cache: Path = CACHE) -> Peer:
    """The pinned wheel of ``name`` as ``make peers`` recorded it, its bytes checked."""
    pin = PINS[name]
    path = cache / MANIFEST
    if not path.is_file():
        raise PeerUnavailable(f"{name} {pin.version}: no {MANIFEST} in .cache/peers (run make peers)")
    entry = json.loads(path.read_text())["peers"].get(name)
    if entry is None or entry.get("version") != pin.version:
        raise PeerUnavailable(f"{name} {pin.version}: not in {MANIFEST} (run make peers)")
    if "missing" in entry:
        raise PeerUnavailable(f"{name} {pin.version}: {entry['missing']}")
    wheel = cache / entry["wheel"]
    if not wheel.is_file():
        raise PeerUnavailable(f"{name} {pin.version}: {entry['wheel']} is gone from .cache/peers (run make peers)")
    digest = sha256(wheel)
    if digest != pin.sha256 or entry["sha256"] != pin.sha256:
        raise RuntimeError(f"{wheel.name}: sha256 {digest} (manifest {entry['sha256']}), pinned {pin.sha256}")
    return Peer(name, pin.version, wheel, digest)


# --------------------------------------------------------------------------- import

STAMP = ".sha256"


def extracted(p: Peer) -> Path:
    """``p.root``: the wheel's files, extracted on first use, each compared with the wheel's
    bytes on every use (a file changed there is an error, not a different peer)."""
    with zipfile.ZipFile(p.wheel) as z:
        stamp = p.root / STAMP
        if not stamp.is_file():
            tmp = p.root.with_name(f".{p.root.name}.{os.getpid()}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            z.extractall(tmp)
            (tmp / STAMP).write_text(p.sha256 + "\n")
            try:
                tmp.rename(p.root)
            except OSError:      # another process extracted it first
                shutil.rmtree(tmp, ignore_errors=True)
        if stamp.read_text().strip() != p.sha256:
            raise RuntimeError(f"{p.root.name} was extracted from another wheel (sha256 {stamp.read_text().strip()})")
        for info in z.infolist():
            if not info.is_dir():
                f = p.root / info.filename
                if not f.is_file() or f.read_bytes() != z.read(info):
                    raise RuntimeError(f"{f.relative_to(p.root.parent)} differs from {p.wheel.name}: "
                                       f"remove {p.root.name} and it is extracted again")
    return p.root



class _AnyType(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls()


class _Anything(metaclass=_AnyType):
    """What a stubbed module hands out for any name: a class (so it can be subclassed or
    annotated with) whose attributes, calls and instances accept anything and do nothing
    (so ``logger.info(...)`` runs)."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __class_getitem__(cls, item):
        return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Anything,), {"__module__": self.__name__})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``_StubModule``s for the named top-level packages and anything under them."""

    def __init__(self, tops: set[str]):
        self.tops = tops

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.tops:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name, "stub: not installed here, not used by the parity checks")
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


@dataclass
class Imported:
    peer: Peer
    modules: dict[str, types.ModuleType] = field(default_factory=dict)
    stubbed: list[str] = field(default_factory=list)

    def record(self) -> dict:
        return {**self.peer.record(), "stubbed": self.stubbed}


@contextmanager
def importing(p: Peer, stubs: tuple[str, ...] = ()) -> Iterator[Imported]:
    """Within the block the peer's files (``extracted``) are first on ``sys.path`` and the
    ``stubs`` that do not import here are served as stubs; afterwards neither is (modules
    imported stay)."""
    root = str(extracted(p))
    missing = {s for s in stubs if s not in sys.modules and importlib.util.find_spec(s) is None}
    finder = _StubFinder(missing)
    sys.path.insert(0, root)
    if missing:
        sys.meta_path.insert(0, finder)
    before = set(sys.modules)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # peers warn about optional kernels (flash_attn) at import
            yield Imported(p, stubbed=sorted(missing))
    finally:
        sys.path.remove(root)
        if missing:
            sys.meta_path.remove(finder)
            for name in set(sys.modules) - before:
                if name.split(".")[0] in missing:
                    del sys.modules[name]


def load(name: str, modules: tuple[str, ...], stubs: tuple[str, ...] = ()) -> Imported:
    """``modules`` of peer ``name`` imported from its wheel (``importing``)."""
    p = peer(name)
    with importing(p, stubs) as got:
        for m in modules:
            module = importlib.import_module(m)
            origin = getattr(module, "__file__", None) or ""
            if not origin.startswith(str(p.root) + os.sep):
                raise RuntimeError(f"{m} was imported from {origin or 'nowhere'}, not from {p.root.name}")
            got.modules[m] = module
    return got


def main(argv=None) -> int:
    harness.parser(__doc__).parse_args(argv)
    manifest = fetch()
    for name, entry in manifest["peers"].items():
        state = entry.get("missing") or f"{entry['wheel']} sha256 {entry['sha256'][:12]}"
        harness.say(f"{name} {entry['version']}: {state}")
    harness.emit({"bench": "peers", "peers": manifest["peers"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
