"""The trace cache's key, and the optimizer's trace as the real step: the memory plan's
traces are kept on disk only as long as the code they ran is the code they would run."""

import hashlib
import json
import subprocess
import sys

import torch
from transformers import Qwen3Config

from dflash_actors.config import TrainConfig
from dflash_actors.models.drafter import DFlashDrafter, drafter_config
from dflash_actors.train import memtrace, optim, tracecache
from tests.support.pipeline import ROOT

SMALL = Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_hidden_layers=4, vocab_size=300, max_position_embeddings=1024)

# Every trace the plan takes, at tiny sizes, in a fresh interpreter: which of the
# project's modules did they import?
EVERY_TRACE = """
import json, sys, torch
from transformers import Qwen3Config
from dflash_actors.config import DrafterConfig, TrainConfig
from dflash_actors.models.drafter import dflash2_fields
from dflash_actors.train import memtrace
c = Qwen3Config(**json.loads(sys.argv[1]))
step = dict(layers=2, block_size=4, feature_layers=2, rows=1, ctx_len=32, anchors=4)
for cuda in (False, True):
    memtrace.trace_drafter_step(c, head_dtype=torch.bfloat16, autocast_bf16=True, cuda=cuda, **step)
memtrace.trace_drafter_step(c, head_dtype=torch.float32, autocast_bf16=False, cuda=False, checkpoint_layers=True,
                            head_loss="checkpointed", loss="distill", **step)
dflash2 = dflash2_fields(DrafterConfig(arch="dflash2", selector_rank=8, selector_top_k=4))
memtrace.trace_drafter_step(c, head_dtype=torch.float32, autocast_bf16=False, cuda=False, dflash2=dflash2, **step)
memtrace.trace_target_forward(c, dtype=torch.bfloat16, rows=1, length=32, layer_ids=[1, 2], teacher=True)
for device in ("cpu", "cuda"):
    memtrace.trace_optimizer_step(c, layers=2, block_size=4, feature_layers=2, drafters=2, train=TrainConfig(),
                                  device=device)
memtrace.target_numel(c)
memtrace.drafter_numel(c, 2, 4, 2)
print(json.dumps(sorted(m for m in sys.modules if m == "dflash_actors" or m.startswith("dflash_actors."))))
"""


def test_the_cache_key_covers_every_module_a_trace_imports():
    small = {k: v for k, v in SMALL.to_dict().items() if k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "num_hidden_layers", "vocab_size", "max_position_embeddings")}
    out = subprocess.run([sys.executable, "-c", EVERY_TRACE, json.dumps(small)], cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = set(json.loads(out.stdout.splitlines()[-1]))
    hashed = set(tracecache.traced_modules())
    assert {"dflash_actors.train.memtrace", "dflash_actors.train.optim", "dflash_actors.models.loss",
            "dflash_actors.models.target"} <= imported
    assert imported <= hashed, f"imported by a trace, not in its cache key: {sorted(imported - hashed)}"


def test_every_traced_modules_text_is_in_the_key():
    version = tracecache.code_version()
    for name in tracecache.traced_modules():
        digest = hashlib.sha256(tracecache._source(name).read_bytes()).hexdigest()
        assert digest in version, name
    assert version.startswith(f"{torch.__version__}:")


def test_a_relative_import_inside_a_function_is_followed():
    # memtrace imports TargetModel inside trace_target_forward only.
    assert "dflash_actors.models.target" in tracecache._imports("dflash_actors.train.memtrace")
    assert "dflash_actors.models.target" in tracecache.traced_modules()


def test_the_cache_reads_what_it_wrote(tmp_path, monkeypatch):
    cache = tracecache.TraceCache(SMALL, tmp_path)
    first = cache.get("drafter_numel", layers=2, block_size=4, feature_layers=2)
    assert len(list(tmp_path.glob("*.json"))) == 1
    monkeypatch.setattr(memtrace, "drafter_numel", lambda *a, **k: (_ for _ in ()).throw(AssertionError("traced")))
    assert tracecache.TraceCache(SMALL, tmp_path).get("drafter_numel", layers=2, block_size=4,
                                                      feature_layers=2) == first


def real_cpu_step_peak(drafters: int = 2) -> tuple[int, int]:
    """(bytes the real optimizer step allocates on the CPU at its peak, the drafter's fp32 bytes)."""
    V = SMALL.vocab_size
    d = DFlashDrafter(drafter_config(SMALL, 2, 4, [0, 1], V - 1, "test", V))
    params = list(d.parameters())
    shards = [[torch.randn_like(p) for p in params] for _ in range(drafters)]
    train = TrainConfig()
    opt, live = optim.build_optimizer(params, train), memtrace.Live()
    sched = optim.build_scheduler(opt, train, 1)
    live.known([*params, *(g for s in shards for g in s)])
    with live:
        optim.reduce_and_step(params, iter(shards), opt, sched, drafters, train.grad_clip)
    return live.peak, 4 * sum(p.numel() for p in params)


def test_the_optimizer_trace_is_the_real_step():
    """On the CPU the trace equals what the real step allocates; on a GPU torch takes
    AdamW's multi-tensor path, whose square roots of the second moments are the whole
    model's at once: a fourth fp32 copy beside the gradient sum and both moments."""
    real, fp32 = real_cpu_step_peak()

    def traced(device):
        return memtrace.trace_optimizer_step(SMALL, layers=2, block_size=4, feature_layers=2, drafters=2,
                                             train=TrainConfig(), device=device).peak
    assert traced("cpu") == real
    assert 3 * fp32 <= real < 4 * fp32 <= traced("cuda")
