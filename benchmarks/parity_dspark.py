"""This project's DSpark step against NeMo Automodel's own, on identical weights, batch and anchors.

    python -m benchmarks.parity_dspark          # one JSON line; exit 1 when they differ

NeMo's ``DSparkTrainerModule`` and ``Qwen3DSparkModel`` are imported unmodified from the
pinned ``nemo-automodel`` wheel (``benchmarks.nemo_dspark``); without the wheel the check
reports ``skipped`` with the reason. Both sides get the same random drafter (Markov and
confidence heads included, at scales where they move the loss), the same frozen
embedding and head, one sequence with its tapped features and the target's last-layer
states (the teacher), and the same anchors (every candidate: NeMo's own draw when it may
take them all). Compared: the loss (0.1 CE + 0.9 L1 + 1.0 BCE, each over its own
weight sum, gamma 4) and the gradient of every trainable parameter by name, on a loss
mask with holes inside blocks (where DSpark ends a block's supervision) and on one
without; and the greedy Markov walk (decoding's proposals) over the same head logits.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
from transformers import Qwen3Config

from benchmarks import harness
from benchmarks import nemo_dspark as nemo
from benchmarks.parity_inputs import draw_drafter, draw_text, frozen_head
from benchmarks.peers import PeerUnavailable
from dflash_actors.data.batching import Batch
from dflash_actors.models.blocks import anchor_candidates, padded_hidden
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.models.dspark import DSparkObjective, markov_walk
from dflash_actors.models.loss import block_stats, blocks_loss, lay_out

RTOL = 1e-4
"""Float32 sums in another order (and NeMo's 1e-6 in each denominator)."""

GAMMA = 4.0
DEEPSPEC = DSparkObjective(0.1, 0.9, 1.0, "l1")


def tiny_config() -> Qwen3Config:
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False,
                      use_sliding_window=False)
    cfg.block_size, cfg.num_target_layers = 4, 4
    cfg.dflash_config = {"mask_token_id": 299, "target_layer_ids": [0, 2], "block_size": 4}
    cfg.markov_rank, cfg.markov_head_type = 8, "vanilla"
    cfg.enable_confidence_head, cfg.confidence_head_with_markov = True, True
    return cfg


def inputs(holes: bool, seed: int = 0) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    config = tiny_config()
    drafter = draw_drafter(DFlashDrafter(config), g, "markov_head.", 0.5)    # a Markov bias that changes the argmax
    text = draw_text(g, config.vocab_size, config.hidden_size, holes)
    return SimpleNamespace(config=config, drafter=drafter, state=drafter.state_dict(), **vars(text))


def ours(x: SimpleNamespace, objective: DSparkObjective = DEEPSPEC, gamma: float = GAMMA) -> dict:
    d, L = x.drafter, x.last.shape[1]
    d.zero_grad(set_to_none=True)
    frozen = frozen_head(x.embed, x.head)
    batch = Batch(x.ids[0], torch.arange(L), x.mask[0].to(torch.int8), torch.tensor([0, L], dtype=torch.int32), L)
    anchors = anchor_candidates(x.mask[0].numpy())
    blocks = lay_out(batch, [anchors], d.block_size, "cpu", d.label_shift)
    features = torch.cat([x.feats, x.last], dim=-1)[0]
    value, tally = blocks_loss(d, frozen, features, blocks, gamma, loss="distill", dspark=objective)
    value.backward()
    with torch.no_grad():
        base = frozen.lm_head(padded_hidden(d, frozen.embed_tokens, features, blocks.p)[0])
    return {"loss": float(value.detach()), "grads": {n: p.grad for n, p in d.named_parameters()}, "anchors": anchors,
            "stats": block_stats(blocks, tally).metrics(), "base_logits": base}


def case(holes: bool, seed: int = 0, objective: DSparkObjective = DEEPSPEC, gamma: float = GAMMA,
         nemo_gamma: float | None = GAMMA) -> dict:
    x = inputs(holes, seed)
    theirs = nemo.nemo_step(x.config, x.state, x.embed, x.head, x.ids, x.mask, x.feats, x.last, nemo_gamma)
    mine = ours(x, objective, gamma)
    grads = mine["grads"]
    worst = max(float((grads[n] - t).abs().max() / t.abs().max().clamp(min=1e-12)) for n, t in theirs["grads"].items())
    anchor_ids = x.ids[0, torch.from_numpy(mine["anchors"])]
    walk = markov_walk(x.drafter.markov_head, mine["base_logits"], anchor_ids)
    walk_equal = bool(torch.equal(walk, nemo.nemo_walk(x.state, x.config, mine["base_logits"], anchor_ids)))
    out = {"case": "holes" if holes else "contiguous", "loss": round(mine["loss"], 6),
           "nemo_loss": round(theirs["loss"], 6), "nemo_terms": {k: round(theirs[k], 6) for k in
                                                                 ("ce_loss", "l1_loss", "confidence_loss")},
           "loss_rel_diff": abs(mine["loss"] - theirs["loss"]) / abs(theirs["loss"]),
           "grads": len(theirs["grads"]), "same_names": set(grads) == set(theirs["grads"]),
           "grad_max_rel_diff": worst, "anchors": len(mine["anchors"]), "nemo_anchors": theirs["anchors"],
           "walk_equal": walk_equal, "walk_differs_from_argmax": bool(
               not torch.equal(walk, mine["base_logits"].argmax(-1))), "tau": round(mine["stats"]["tau"], 4)}
    out["ok"] = bool(out["loss_rel_diff"] < RTOL and worst < RTOL and out["same_names"] and walk_equal
                     and out["anchors"] == out["nemo_anchors"])
    return out


def main(argv=None) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    try:
        loaded = nemo.load_nemo()
    except PeerUnavailable as e:
        harness.skipped("parity_dspark", str(e), args.save)
        return 0
    torch.set_num_threads(1)
    cases = [case(holes=h) for h in (True, False)]
    line = {"bench": "parity_dspark", **loaded.record, "torch": torch.__version__,
            "ok": all(c["ok"] for c in cases), "cases": cases}
    harness.emit(line, args.save)
    return 0 if line["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
