"""This project's XPress objective against speculators 0.9.0's own, on identical weights and blocks.

    python -m benchmarks.parity_xpress          # one JSON line; exit 1 when they differ

speculators' ``XPressDraftModel.forward`` (``models/xpress/core.py``: the teacher-forced
and free-running previous tokens, the rounds and their argmax hand-over), its
``XPressRefinerHead`` (``model_definitions.py``) and ``compute_metrics`` (``metrics.py``,
through ``losses/utils.py``'s compound loss and ``eager.py``'s CE and TV) are imported
unmodified from the pinned wheel (``loguru`` and ``hs_connectors``, which this path does
not use, stubbed while it imports). Not run: speculators' DFlash backbone
(``_backbone_forward``: flex attention, its own anchor draw and verifier loading); in its
place the forward is handed this project's backbone output for the same blocks, so both
sides start from the same drafter states and ``forward`` is called as the class defines
it with ``self`` a stand-in carrying the refiner. Its default loss config builds the
fused (Triton) kernels, which need CUDA: it is given the eager implementation of the
same ``{"ce": 0.1, "tv": 0.9}``.

Compared: the loss, and the gradient of every trainable tensor (the backbone's through
the drafter states both sides differentiate, the refiner's nine by name), on a loss mask
with holes inside blocks and on one without. speculators divides by the count of
supervised slots, this project by the sum of their weights: this check gives ours the
count (``total_weight``), so that the numerators are what is compared.
"""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from benchmarks import harness, peers
from benchmarks.parity_inputs import LENGTH, draw_drafter, draw_text, frozen_head
from dflash_actors.data.batching import Batch
from dflash_actors.models.blocks import anchor_candidates, padded_hidden
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.models.loss import block_stats, blocks_loss, lay_out
from dflash_actors.models.xpress import XPressObjective

STUBS = ("loguru", "hs_connectors")
CORE, DEFS, LOSSES = "speculators.models.xpress.core", "speculators.models.xpress.model_definitions", \
    "speculators.losses"
RTOL = 1e-4
"""Float32 sums in another order (and speculators' 1e-5 in its denominator, given to ours too)."""
GAMMA = 4.0
SPECULATORS = XPressObjective()      # 0.1 CE + 0.9 TV, 3 rounds at 0.3, anchor 0.6, target-argmax CE
B, L = 4, LENGTH


def load():
    return peers.load("speculators", (CORE, DEFS, LOSSES), stubs=STUBS)


def tiny_config() -> Qwen3Config:
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False,
                      use_sliding_window=False)
    cfg.block_size, cfg.num_target_layers = B, 4
    cfg.dflash_config = {"mask_token_id": 299, "target_layer_ids": [0, 2], "block_size": B}
    cfg.xpress_rank, cfg.xpress_mlp_ratio, cfg.num_jacobi_passes = 8, 2, 6
    return cfg


def inputs(holes: bool, seed: int = 0) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    config = tiny_config()
    drafter = draw_drafter(DFlashDrafter(config), g, "refiner_head.", 0.3)    # a bias that moves some argmaxes
    text = draw_text(g, config.vocab_size, config.hidden_size, holes)
    # Anchors whose whole block lies inside the text (speculators indexes every slot's token),
    # position 0 among them (its slot 0 then reads the anchor as its previous token).
    anchors = [0] + [int(a) for a in anchor_candidates(text.mask[0].numpy()) if a + B <= L]
    return SimpleNamespace(config=config, drafter=drafter, anchors=anchors, **vars(text))


def frozen(x: SimpleNamespace) -> SimpleNamespace:
    return frozen_head(x.embed, x.head)


def layout(x: SimpleNamespace, d: DFlashDrafter):
    import numpy as np
    batch = Batch(x.ids[0], torch.arange(L), x.mask[0].to(torch.int8), torch.tensor([0, L], dtype=torch.int32), L)
    return lay_out(batch, [np.array(x.anchors)], d.block_size, "cpu", d.label_shift)


def ours(x: SimpleNamespace, objective: XPressObjective = SPECULATORS) -> dict:
    d = x.drafter
    d.zero_grad(set_to_none=True)
    blocks = layout(x, d)
    features = torch.cat([x.feats, x.last], dim=-1)[0]
    count = len(blocks.rows[0]) + 1e-5
    value, tally = blocks_loss(d, frozen(x), features, blocks, GAMMA, loss="distill", xpress=objective,
                               total_weight=torch.tensor(count))
    value.backward()
    return {"loss": float(value.detach()), "grads": {n: p.grad for n, p in d.named_parameters()},
            "stats": block_stats(blocks, tally).metrics(), "supervised": len(blocks.rows[0])}


def theirs(x: SimpleNamespace, got, ce_from_data: bool = False) -> dict:
    """speculators' ``XPressDraftModel.forward`` on a copy of the drafter: its backbone
    output (this project's code) handed over in place of ``_backbone_forward``."""
    core, defs, losses = (got.modules[m] for m in (CORE, DEFS, LOSSES))
    d = copy.deepcopy(x.drafter)
    d.zero_grad(set_to_none=True)
    cfg = x.config
    refiner = defs.XPressRefinerHead(verifier_vocab_size=cfg.vocab_size, draft_vocab_size=cfg.vocab_size,
                                     hidden_size=cfg.hidden_size, block_size=B, rank=cfg.xpress_rank,
                                     mlp_ratio=cfg.xpress_mlp_ratio)
    prefix = "refiner_head."
    refiner.load_state_dict({k[len(prefix):]: v for k, v in x.drafter.state_dict().items() if k.startswith(prefix)})
    blocks = layout(x, d)
    f = frozen(x)
    features = torch.cat([x.feats, x.last], dim=-1)[0]
    hidden = padded_hidden(d, f.embed_tokens, features, blocks.p)[0]             # [N, B, H]
    N = hidden.shape[0]
    idx = (torch.tensor(x.anchors)[:, None] + torch.arange(B)).reshape(-1)
    flat = hidden.reshape(1, N * B, -1)
    logits = F.linear(flat, x.head)
    with torch.no_grad():
        targets = F.linear(x.last[:, (idx - 1) % L], x.head)          # the target's logits one position back
    mask = x.mask[:, idx].clone()
    mask[:, ::B] = 0                                                   # slot 0 is the anchor
    stand_in = SimpleNamespace(refiner_head=refiner, block_size=B, d2t=None,
                               config=SimpleNamespace(sample_from_anchor=False),
                               _backbone_forward=lambda *a, **k: (flat, logits, targets, mask, idx))
    stand_in._draft_to_verifier_ids = lambda ids: core.XPressDraftModel._draft_to_verifier_ids(stand_in, ids)
    _, loss, metrics = core.XPressDraftModel.forward(
        stand_in, hidden_states=None, input_ids=x.ids, loss_mask=x.mask, verifier_last_hidden_states=x.last,
        document_ids=torch.zeros_like(x.ids), max_anchors=N,
        loss_config=losses.resolve_loss_config('{"ce": 0.1, "tv": 0.9}', "eager"), gamma=GAMMA,
        ce_from_data=ce_from_data)
    loss.backward()
    grads = {n: p.grad for n, p in d.named_parameters() if not n.startswith(prefix)}
    grads |= {prefix + n: p.grad for n, p in refiner.named_parameters()}
    return {"loss": float(loss.detach()), "grads": grads, "supervised": int(mask.sum()),
            "terms": {k.removesuffix("_sum"): round(float(v), 6) for k, v in metrics.items()
                      if k.endswith("loss_sum")}}


def case(got, holes: bool, seed: int = 0, objective: XPressObjective = SPECULATORS,
         ce_from_data: bool = False) -> dict:
    x = inputs(holes, seed)
    mine, peer = ours(x, objective), theirs(x, got, ce_from_data)
    worst = max(float((mine["grads"][n] - t).abs().max() / t.abs().max().clamp(min=1e-12))
                for n, t in peer["grads"].items())
    out = {"case": "holes" if holes else "contiguous", "loss": round(mine["loss"], 6),
           "speculators_loss": round(peer["loss"], 6), "speculators_terms": peer["terms"],
           "loss_rel_diff": abs(mine["loss"] - peer["loss"]) / abs(peer["loss"]),
           "grads": len(peer["grads"]), "same_names": set(mine["grads"]) == set(peer["grads"]),
           "grad_max_rel_diff": worst, "blocks": len(x.anchors), "supervised": mine["supervised"],
           "speculators_supervised": peer["supervised"], "tau_teacher_forced": round(mine["stats"]["tau"], 4)}
    out["ok"] = bool(out["loss_rel_diff"] < RTOL and worst < RTOL and out["same_names"]
                     and out["supervised"] == out["speculators_supervised"])
    return out


def main(argv=None) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    try:
        got = load()
    except peers.PeerUnavailable as e:
        harness.skipped("parity_xpress", str(e), args.save)
        return 0
    torch.set_num_threads(1)
    cases = [case(got, holes=h) for h in (True, False)]
    line = {"bench": "parity_xpress", **got.record(), "torch": torch.__version__,
            "ok": all(c["ok"] for c in cases), "cases": cases}
    harness.emit(line, args.save)
    return 0 if line["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
