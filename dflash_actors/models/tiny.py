"""The demo's target: a tiny Qwen3 built from ``target.tiny`` and fitted to the synthetic data.

With ``target.path`` unset the job trains against this model, built once per
(shape, grammar) and cached in ``data.cache_dir``: a seeded random Qwen3 fitted for
``target.tiny.pretrain_steps`` steps to the synthetic train split, so that its greedy
text follows the grammar instead of repeating a token. Concurrent builders (the
parent, a test, a benchmark) race harmlessly: the first complete directory stays.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from ..data.dataset import open_dataset
from ..data.synthetic import ensure_synthetic_dataset
from ..runtime.files import write_atomically
from .target_dir import is_hf_dir


def tiny_target_config(cfg) -> Qwen3Config:
    t, syn = cfg.target.tiny, cfg.data.synthetic
    return Qwen3Config(
        vocab_size=syn.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads, head_dim=t.hidden_size // t.num_heads,
        max_position_embeddings=max(4096, cfg.data.max_seq_len + 64), tie_word_embeddings=False)


def ensure_tiny_target(cfg) -> Path:
    """The tiny target's directory, built on first use (module docstring)."""
    train_dir, _ = ensure_synthetic_dataset(cfg.data)
    # The data directory's name is the hash of the grammar and its recipe: a new grammar
    # means a new target.
    key = json.dumps([dataclasses.asdict(cfg.target.tiny), train_dir.parent.name,
                      cfg.data.max_seq_len, _TINY_RECIPE], sort_keys=True)
    out = Path(cfg.data.cache_dir) / f"tiny-target-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if is_hf_dir(out):
        return out
    return write_atomically(out, _pretrain_tiny(cfg, train_dir).save_pretrained, keep_existing=True)


# Bump when the fitting procedure changes, so cached targets are rebuilt.
_TINY_RECIPE = {"version": 1, "lr": 3e-3, "seed": 0x7A46E7}


def _pretrain_tiny(cfg, train_dir: Path) -> Qwen3ForCausalLM:
    ds = open_dataset(cfg.data, progress=False, path=train_dir)
    seed, lr, bs = _TINY_RECIPE["seed"], _TINY_RECIPE["lr"], cfg.target.tiny.pretrain_batch
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.train.num_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(tiny_target_config(cfg))
        model.config.architectures = ["Qwen3ForCausalLM"]
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        steps = cfg.target.tiny.pretrain_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / max(1, steps))
        rng = np.random.default_rng([seed])
        model.train()
        for _ in range(steps):
            ids = [ds.sample(int(i))[0] for i in rng.integers(0, len(ds), bs)]
            top = max(len(x) for x in ids)
            x = torch.zeros(bs, top, dtype=torch.long)
            labels = torch.full((bs, top), -100, dtype=torch.long)
            for r, s in enumerate(ids):
                x[r, :len(s)] = torch.from_numpy(s)
                labels[r, :len(s)] = torch.from_numpy(s)
            loss = model(input_ids=x, labels=labels, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        return model.eval()
    finally:
        torch.set_num_threads(threads)
