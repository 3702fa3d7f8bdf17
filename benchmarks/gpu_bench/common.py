"""What every section shares: the shapes measured, the JSON line each prints (``benchmarks.harness``'s
protocol: stamped, paths relative, progress on stderr), timing, memory and device helpers.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import ROOT, say  # noqa: F401 - the sections' root and progress

GIB = 2 ** 30


SPECFORGE_MFU = 0.44
"""SpecForge's reported DFlash trainer MFU on an H200: the public anchor for 2b."""


QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                max_position_embeddings=40960, tie_word_embeddings=False)


TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rope_theta=1e6, max_position_embeddings=4096,
            tie_word_embeddings=False)


PLAN_FILE = "pipeline_plan.json"
"""2c's plan, in the work folder: what 2b and 2c are sized by (``prepare``)."""


FALLBACK_BLOCK_TOKENS = 8192
"""2b's micro-batch should ``--plan-only`` fail: a step is still measured (and the failure reported)."""


@dataclass(frozen=True)
class Sizes:
    """One measurement's shapes and repetitions."""

    model: dict
    rows: int               # sequences per batch
    seq_len: int            # tokens per sequence
    draft_layers: int
    block_size: int
    num_anchors: int
    warmup: int
    runs: int


FULL = Sizes(QWEN3_8B, rows=8, seq_len=2048, draft_layers=5, block_size=16, num_anchors=512, warmup=1, runs=3)


SMOKE = Sizes(TINY, rows=2, seq_len=64, draft_layers=2, block_size=4, num_anchors=8, warmup=1, runs=2)


def sig(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


def gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else round(nbytes / GIB, 3)


def mib_gib(mib: float | None) -> float | None:
    """status.json's MiB as GiB; None where the process reported none."""
    return round(mib / 1024, 3) if mib else None


def write_json(data: dict, path: str) -> None:
    """``data`` as one line in ``path``, whole (by rename): a reader never sees half of it."""
    harness.write_text(Path(path), json.dumps(data) + "\n")


def emit(result: dict, out: str | None) -> None:
    """Print ``result`` as one line and write it to ``out``, whole (``harness.emit``)."""
    harness.emit(result, out)


def error_line(e: BaseException) -> str:
    """``Type: first line`` of ``e`` (``console.first_line``), short enough for a section's line."""
    from dflash_actors.console import first_line

    return f"{type(e).__name__}: {first_line(e)}"[:400]


def read_json(path: Path) -> dict:
    """The JSON object in ``path``, or {} where it is missing or cut short."""
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            return data
    return {}


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, warmup: int, runs: int, device) -> list[float]:
    """Seconds of ``fn(i)`` for ``runs`` calls after ``warmup`` untimed ones (i counts all calls)."""
    for i in range(warmup):
        fn(i)
        sync(device)
    out = []
    for i in range(warmup, warmup + runs):
        t = time.perf_counter()
        fn(i)
        sync(device)
        out.append(time.perf_counter() - t)
    return out


def reset_memory(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def memory_gib(device) -> dict:
    """This process's CUDA memory on ``device`` (GiB): now and the peaks since the last
    reset, allocated and reserved; Nones on the CPU."""
    import torch

    if device.type != "cuda":
        return {"allocated_gib": None, "max_allocated_gib": None, "max_reserved_gib": None}
    return {"allocated_gib": gib(torch.cuda.memory_allocated(device)),
            "max_allocated_gib": gib(torch.cuda.max_memory_allocated(device)),
            "max_reserved_gib": gib(torch.cuda.max_memory_reserved(device))}


@contextlib.contextmanager
def building_on(device, dtype):
    """Modules created inside get their parameters on ``device`` in ``dtype`` directly."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def setup(smoke: bool):
    import torch

    if smoke:
        torch.set_num_threads(1)
        return torch.device("cpu"), SMOKE
    return torch.device("cuda:0"), FULL


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
