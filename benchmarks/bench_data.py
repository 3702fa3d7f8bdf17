"""Data plane benchmark: memory-mapped open vs materializing, planning, assembly vs naive padding.

    python -m benchmarks.bench_data --samples 200000

Generates a lognormal-length dataset (mean ~2000 tokens, capped at 8192) as an HF
``save_to_disk``-style directory under a temp dir, then measures, in this one run:

  open_s                  TokenDataset(path): map shards, read offsets, validate structure
                          (fresh process; pyarrow's one-time import cost is pyarrow_init_s)
  scan_s                  check_values(): one vectorised pass over every token
  materialize_s           the seed's way: to_pylist() of input_ids and loss_mask, timed on a
                          subset and extrapolated by token count
  plan_s                  one epoch's token-budget plan
  assemble_ms_median      packed assembly of a token_budget batch into preallocated buffers
  naive_pad_ms_median     the seed's way: pad Python lists to [B, Lmax], torch.tensor()
  padding_efficiency      real tokens / [B, Lmax] slot tokens over the epoch
  rss_mb / rss_mb_small   anonymous resident memory added by open, at N and N/10 samples
                          (file-backed pages of the map are page cache, not counted)

Prints one JSON line.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import harness


def make_dataset(path: Path, n: int, seed: int = 0, shards: int = 8) -> None:
    from dflash_actors.data.synthetic import write_token_dataset
    rng = np.random.default_rng(seed)
    # lognormal with mean ~2000: mean = exp(mu + sigma^2 / 2)
    sigma = 0.8
    mu = np.log(2000) - sigma ** 2 / 2
    lengths = np.clip(rng.lognormal(mu, sigma, n).astype(np.int64), 16, 8192)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(0, 32000, int(offsets[-1]), dtype=np.int32)
    mask = (rng.random(int(offsets[-1]), dtype=np.float32) < 0.8).astype(np.int8)
    write_token_dataset(path, offsets, ids, mask, num_shards=shards, rows_per_batch=1000)


def rss_anon_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure_open(path: str) -> dict:
    """Run in a fresh interpreter so RSS is not polluted by generation."""
    import pyarrow as pa
    import torch  # noqa: F401  (the actors import it anyway; keep it out of the delta)

    from dflash_actors.data.dataset import TokenDataset
    # pyarrow's first array call imports pandas when installed (~0.2-0.3 s, once per
    # process, independent of the data): time it apart from the open.
    t = time.perf_counter()
    pa.array([0]).to_numpy()
    init_s = time.perf_counter() - t
    before = rss_anon_mb()
    t = time.perf_counter()
    ds = TokenDataset(path, max_seq_len=8192, progress=False)
    open_s = time.perf_counter() - t
    return {"open_s": open_s, "pyarrow_init_s": init_s, "rss_mb": rss_anon_mb() - before, "samples": len(ds)}


def open_in_subprocess(path: Path) -> dict:
    code = ("import json; from benchmarks.bench_data import measure_open; "
            f"print(json.dumps(measure_open({str(path)!r})))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def materialize_seconds(path: Path, total_tokens: int, subset_rows: int) -> float:
    import pyarrow as pa

    from dflash_actors.data.dataset import _shard_paths
    shard = _shard_paths(path)[0]
    table = pa.ipc.open_stream(pa.memory_map(str(shard))).read_all().slice(0, subset_rows)
    t = time.perf_counter()
    ids = table.column("input_ids").to_pylist()
    mask = table.column("loss_mask").to_pylist()
    dt = time.perf_counter() - t
    tokens = sum(len(x) for x in ids)
    del ids, mask
    return dt * total_tokens / tokens


def naive_pad(ids_lists, mask_lists, pad_id=0):
    """What the seed did per batch: pad Python lists to the longest, then torch.tensor."""
    import torch
    longest = max(len(x) for x in ids_lists)
    ids = [x + [pad_id] * (longest - len(x)) for x in ids_lists]
    mask = [m + [0] * (longest - len(m)) for m in mask_lists]
    attn = [[1] * len(x) + [0] * (longest - len(x)) for x in ids_lists]
    return torch.tensor(ids), torch.tensor(mask), torch.tensor(attn)


def main(argv=None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--token-budget", type=int, default=65536)
    ap.add_argument("--batches", type=int, default=50, help="batches timed for assembly")
    ap.add_argument("--materialize-rows", type=int, default=2000)
    ap.add_argument("--dir", default=None, help="where to generate (default: a temp dir)")
    args = ap.parse_args(argv)

    from dflash_actors.data.batching import BatchBuffers, assemble, plan_epoch
    from dflash_actors.data.dataset import TokenDataset

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        big, small = Path(tmp) / "big", Path(tmp) / "small"
        t = time.perf_counter()
        make_dataset(big, args.samples, seed=0)
        make_dataset(small, max(1, args.samples // 10), seed=1)
        gen_s = time.perf_counter() - t

        # Median of three fresh processes: one open is ~10 ms, so scheduler noise matters.
        runs = sorted((open_in_subprocess(big) for _ in range(3)), key=lambda r: r["open_s"])
        opened = runs[1]
        opened_small = open_in_subprocess(small)

        ds = TokenDataset(big, max_seq_len=8192, progress=False)
        t = time.perf_counter()
        ds.check_values(32000, progress=False)
        scan_s = time.perf_counter() - t

        materialize_s = materialize_seconds(big, ds.num_tokens, args.materialize_rows)

        t = time.perf_counter()
        plan = plan_epoch(ds.lengths, args.token_budget, 512, 64, seed=0, epoch=0)
        plan_s = time.perf_counter() - t
        stats = plan.stats(ds.lengths, args.token_budget)

        buf = BatchBuffers.allocate(args.token_budget, 512)
        chosen = range(min(args.batches, len(plan)))
        asm = []
        for b in chosen:
            t = time.perf_counter()
            assemble(ds, plan.batch(b), buf)
            asm.append(time.perf_counter() - t)

        naive = []
        for b in chosen:
            # Give the naive path its inputs as Python lists already (as after the seed's
            # 895 s materialization), so only the padding itself is timed.
            rows = [ds.sample(int(i)) for i in plan.batch(b)]
            ids_l, mask_l = [r[0].tolist() for r in rows], [r[1].tolist() for r in rows]
            t = time.perf_counter()
            naive_pad(ids_l, mask_l)
            naive.append(time.perf_counter() - t)

    result = {
        "bench": "data",
        "samples": args.samples,
        "tokens": ds.num_tokens,
        "generate_s": round(gen_s, 2),
        "open_s": round(opened["open_s"], 4),
        "pyarrow_init_s": round(opened["pyarrow_init_s"], 3),
        "scan_s": round(scan_s, 3),
        "materialize_s": round(materialize_s, 2),
        "materialize_over_open": round(materialize_s / opened["open_s"], 1),
        "plan_s": round(plan_s, 4),
        "assemble_ms_median": round(1e3 * statistics.median(asm), 3),
        "naive_pad_ms_median": round(1e3 * statistics.median(naive), 2),
        "naive_over_assemble": round(statistics.median(naive) / statistics.median(asm), 1),
        "padding_efficiency": stats["padding_efficiency"],
        "budget_fill": stats["budget_fill"],
        "batches": stats["batches"],
        "samples_per_batch": [stats["min_samples"], stats["max_samples"], stats["mean_samples"]],
        "rss_mb": round(opened["rss_mb"], 1),
        "rss_mb_small": round(opened_small["rss_mb"], 1),
    }
    return harness.emit(result, args.save)


if __name__ == "__main__":
    main()
