"""NVIDIA NeMo Automodel's own DSpark training step, runnable here, as a parity reference.

As with ``benchmarks.nemo_dflash2``: nothing of NeMo is copied into this project. Its
modules are imported *unmodified* from the pinned ``nemo-automodel`` 0.7.0 wheel
(``benchmarks.peers``: hash-checked, extracted, each file compared with the wheel's), their
package ``__init__``s bypassed by registering empty packages whose ``__path__`` points at
the wheel's directories (the ``__init__``s import most of the framework). The leaves
imported are ``speculative/dspark/{_sampling, common, markov_head, loss, core,
draft_qwen3}.py`` and ``attention/dflash_mask.py``; nothing is stubbed.

This file builds NeMo's ``Qwen3DSparkModel`` (sdpa, float32, CPU) from a config and
weights, wraps it in ``DSparkTrainerModule`` and runs forward and backward on one sequence.
Anchors are NeMo's own draw with ``num_anchors`` equal to the number of candidates, so it
takes every candidate (``sample_anchor_positions`` in ``common.py``: all valid positions,
sorted), and nothing of NeMo is patched.

NeMo's DSpark semantics (0.7.0 wheel, ``components/speculative/dspark/``):
  * candidates ``a <= L-2`` with ``m[a] > .5`` and ``m[a+1] > .5``; slot k's label is
    ``tok[a+k+1]`` (``draft_qwen3.py`` ``label_offsets = arange(1, bs+1)``); supervised
    while ``a+k+1 < L``, ``m[a+k+1]`` and every earlier slot is (``build_eval_mask``'s
    cumprod);
  * the block, mask, positions and backbone are DFlash's (``create_noise_embed``,
    ``create_dflash_sdpa_mask``, ``create_position_ids``);
  * logits ``lm_head(h) + markov_w2(markov_w1(prev))``, ``prev = [tok[a], labels[:-1]]``
    (``VanillaMarkov.apply_block_logits``); the confidence logit ``proj([h ; W1[prev]])``;
  * the teacher's logits for slot k: ``lm_head(last[a+k])`` (``target_pred_indices =
    label - 1``), detached;
  * ``loss = .1 CE + .9 L1 + 1.0 BCE(conf, clamp(1 - L1/2))``, each ``sum(x w) / (sum(w)
    + 1e-6)``, ``w = eval_mask * exp(-k/gamma)`` (``loss.py``).

Run ``python -m benchmarks.nemo_dspark`` for a smoke step (one JSON line).
"""

from __future__ import annotations

import copy
import sys
import types
from functools import lru_cache

import torch
from torch import nn

from benchmarks import harness, peers

_DSPARK = "nemo_automodel.components.speculative.dspark"
_PACKAGES = ("nemo_automodel", "nemo_automodel.components", "nemo_automodel.components.attention",
             "nemo_automodel.components.speculative", _DSPARK)
_LEAVES = ("nemo_automodel.components.attention.dflash_mask", f"{_DSPARK}._sampling", f"{_DSPARK}.common",
           f"{_DSPARK}.markov_head", f"{_DSPARK}.loss", f"{_DSPARK}.core", f"{_DSPARK}.draft_qwen3")


@lru_cache(maxsize=None)
def load_nemo() -> types.SimpleNamespace:
    """NeMo's DSpark modules from the pinned wheel (``peers.PeerUnavailable`` without it)."""
    import importlib

    nemo = peers.peer("nemo-automodel")
    with peers.importing(nemo) as imported:
        for name in _PACKAGES:
            path = str(nemo.root.joinpath(*name.split(".")))
            have = sys.modules.get(name)
            if have is not None:
                if path not in list(getattr(have, "__path__", [])):
                    raise RuntimeError(f"{name} is already imported from elsewhere, not from {path}")
                continue
            pkg = types.ModuleType(name)
            pkg.__path__, pkg.__package__, pkg.__file__ = [path], name, None
            sys.modules[name] = pkg
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, pkg)
        mods = {name.rsplit(".", 1)[-1]: importlib.import_module(name) for name in _LEAVES}
    for m in mods.values():
        if not m.__file__.startswith(str(nemo.root)):
            raise RuntimeError(f"{m.__name__} was imported from {m.__file__}, not from {nemo.root.name}")
    return types.SimpleNamespace(record=imported.record(), modules=mods,
                                 Qwen3DSparkModel=mods["draft_qwen3"].Qwen3DSparkModel,
                                 DSparkTrainerModule=mods["core"].DSparkTrainerModule,
                                 VanillaMarkov=mods["markov_head"].VanillaMarkov)


def nemo_config(config, num_anchors: int):
    """``config`` (this project's DSpark config) as NeMo's draft reads it: the flat keys,
    float32, sdpa."""
    cfg = copy.deepcopy(config)
    dc = cfg.dflash_config
    cfg.mask_token_id, cfg.target_layer_ids = int(dc["mask_token_id"]), list(dc["target_layer_ids"])
    cfg.num_anchors = int(num_anchors)
    cfg._attn_implementation = "sdpa"
    return cfg


def nemo_step(config, state: dict, embed: torch.Tensor, head: torch.Tensor, ids: torch.Tensor,
              mask: torch.Tensor, feats: torch.Tensor, last: torch.Tensor, gamma: float | None,
              alphas: tuple[float, float, float] = (0.1, 0.9, 1.0)) -> dict:
    """One ``DSparkTrainerModule`` forward + backward on ``ids`` ``[1, L]`` with loss mask
    ``mask``, tapped features ``feats`` ``[1, L, k*H]`` and the target's last-layer states
    ``last`` ``[1, L, H]``: the loss, its terms, every drafter gradient by name (embeddings
    and head frozen) and the logits NeMo scored (``[N, bs, V]``, Markov-corrected)."""
    ns = load_nemo()
    m = mask.reshape(-1)
    candidates = int(((m[:-1] > 0.5) & (m[1:] > 0.5)).sum())
    draft = ns.Qwen3DSparkModel(nemo_config(config, candidates)).to(torch.float32)
    full = dict(state) | {"embed_tokens.weight": embed, "lm_head.weight": head}
    missing, unexpected = draft.load_state_dict(full, strict=False)
    if missing or unexpected:
        raise KeyError(f"NeMo's Qwen3DSparkModel: missing {missing}, unexpected {unexpected}")
    draft.initialize_embeddings_and_head(embed_tokens=nn.Embedding.from_pretrained(embed),
                                         lm_head=_linear(head), freeze=True)
    trainer = ns.DSparkTrainerModule(draft, loss_decay_gamma=gamma, ce_loss_alpha=alphas[0],
                                     l1_loss_alpha=alphas[1], confidence_head_alpha=alphas[2])
    trainer.train()
    captured = {}
    original = draft.markov_head.apply_block_logits

    def recording(*args, **kwargs):      # an instance attribute; NeMo's class is untouched
        out = original(*args, **kwargs)
        captured["logits"] = out.detach()
        return out
    draft.markov_head.apply_block_logits = recording
    try:
        out = trainer(input_ids=ids.long(), target_hidden_states=feats.float(), loss_mask=mask.float(),
                      target_last_hidden_states=last.float())
        out.loss.backward()
    finally:
        del draft.markov_head.apply_block_logits
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in draft.named_parameters() if p.requires_grad}
    return {"loss": float(out.loss.detach()), "ce_loss": float(out.ce_loss), "l1_loss": float(out.l1_loss),
            "confidence_loss": float(out.confidence_loss), "grads": grads, "logits": captured["logits"][0],
            "anchors": candidates, "peer": ns.record}


def nemo_walk(state: dict, config, base_logits: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
    """NeMo's ``VanillaMarkov.sample_block_tokens`` at temperature 0: ``[N, bs]`` proposals
    from the head's own logits ``[N, bs, V]`` after the anchors ``[N]``."""
    ns = load_nemo()
    head = ns.VanillaMarkov(vocab_size=int(config.vocab_size), markov_rank=int(config.markov_rank))
    head.load_state_dict({k.removeprefix("markov_head."): v for k, v in state.items()
                          if k.startswith("markov_head.")}, strict=True)
    with torch.no_grad():
        tokens, _ = head.sample_block_tokens(base_logits.float(), first_prev_token_ids=anchor_ids.long(),
                                             hidden_states=None, temperature=0.0)
    return tokens


def _linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return lin


def main(argv=None) -> None:
    from benchmarks.parity_dspark import inputs

    args = harness.parser(__doc__).parse_args(argv)
    x = inputs(holes=True)
    res = nemo_step(x.config, x.state, x.embed, x.head, x.ids, x.mask, x.feats, x.last, 4.0)
    harness.emit({"bench": "nemo_dspark", **res["peer"], "loss": round(res["loss"], 6),
                  "ce_loss": round(res["ce_loss"], 6), "l1_loss": round(res["l1_loss"], 6),
                  "confidence_loss": round(res["confidence_loss"], 6), "anchors": res["anchors"],
                  "n_grads": len(res["grads"])}, args.save)


if __name__ == "__main__":
    main()
