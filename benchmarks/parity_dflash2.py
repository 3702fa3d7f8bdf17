"""This project's DFlash2 step against NeMo Automodel's own, on identical weights, batch and anchors.

    python -m benchmarks.parity_dflash2          # one JSON line; exit 1 when they differ

NeMo's ``DFlash2TrainerModule`` and ``Qwen3DFlash2DraftModel`` are imported unmodified from
the pinned ``nemo-automodel`` wheel (``make peers``; ``benchmarks.nemo_dflash2`` says how
its package ``__init__``s are bypassed), and the line names that wheel and its sha256;
without the wheel the check reports ``skipped`` with the reason. Both sides get the same
random drafter (its identity start broken: conv taps, dynamic projections and codebooks all
random), the same frozen embedding and head, one sequence with its target features, and the
same anchors: ones both trainers could draw (``m[a] = m[a+1] = 1`` here, ``a <= L - B``
there). The project runs with NeMo's selector semantics (``train.selector_norm: own``,
``selector_misses: skip``, ``selector_grad: full``, weight 1) and compares:

* the loss (block term plus selector term) and the gradient of every parameter, by name;
* the selector path's accuracy and acceptance, the backbone's beside it and the candidate
  recall (on a loss mask without holes after the prompt: NeMo lets a slot outside the loss
  continue a run of accepted slots, this project ends the run there, as decoding does);
* the greedy walk over the same hidden states and logits (decoding's proposal).

Two cases: a mask with holes inside blocks (loss and gradients only) and one without; and
both again with every layer ``sliding_attention`` of a window of 8 (NeMo's
``sliding_window``), which cuts the context of every block anchored past position 8.
"""

from __future__ import annotations

import copy
import sys

import numpy as np
import torch

from benchmarks import harness
from benchmarks import nemo_dflash2 as nemo
from benchmarks.parity_inputs import LENGTH, draw_text, frozen_head
from benchmarks.peers import PeerUnavailable
from dflash_actors.data.batching import Batch
from dflash_actors.models.dflash2 import SelectorObjective
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.models.loss import block_stats, blocks_loss, lay_out

RTOL = 1e-4
"""Float32 sums in another order (and NeMo's 1e-6 in each denominator)."""

GAMMA = 7.0


def acceptable_text(drafter, frozen, ids: torch.Tensor, feats: torch.Tensor, anchors: list[int]) -> torch.Tensor:
    """``ids`` with the blocks after ``anchors`` (apart, ``B`` each) rewritten so that the
    acceptances differ: block 0 is the selector's walk (all accepted), block 1 the
    backbone's argmax, block 2 the walk with its second draft wrong, the rest random.
    A block's drafter states depend on its anchor token alone, so rewriting the slots
    after it changes what is right, not what is proposed."""
    B, L = drafter.block_size, ids.shape[1]
    batch = Batch(ids[0], torch.arange(L), torch.ones(L, dtype=torch.int8), torch.tensor([0, L], dtype=torch.int32), L)
    blocks = lay_out(batch, [np.array(anchors)], B, "cpu")
    from dflash_actors.models.blocks import padded_hidden
    with torch.no_grad():
        hidden = padded_hidden(drafter, frozen.embed_tokens, feats[0], blocks.p)[0][:, 1:]
        logits = frozen.lm_head(hidden)
        walk = drafter.candidate_selector.walk(hidden, logits, ids[0, torch.tensor(anchors)])
    out = ids.clone()
    for j, draft in ((0, walk[0]), (1, logits[1].argmax(-1)), (2, walk[2].clone())):
        if j == 2:
            draft[1] = (draft[1] + 1) % 8
        out[0, anchors[j] + 1:anchors[j] + B] = draft
    return out


NEMO_SEMANTICS = SelectorObjective(1.0, "own", "skip", "full")


WINDOW = 8


def case(holes: bool, seed: int = 0, objective: SelectorObjective = NEMO_SEMANTICS, window: int | None = None,
         our_window: int | None | str = "same") -> dict:
    """``window``: NeMo's ``sliding_window`` and, unless ``our_window`` says otherwise (a
    control: another window, or None for full attention), every layer of ours
    ``sliding_attention`` of that window."""
    g = torch.Generator().manual_seed(seed)
    config = nemo.tiny_config()
    ours_w = window if our_window == "same" else our_window
    ours_config = copy.deepcopy(config)
    if ours_w is not None:
        ours_config.layer_types = ["sliding_attention"] * config.num_hidden_layers
        ours_config.sliding_window, ours_config.use_sliding_window = ours_w, True
    L = LENGTH
    state = nemo.random_state(config, g)
    # The text's tokens lead the logits: many land in the top-K (its last layer is unused here).
    text = draw_text(g, config.vocab_size, config.hidden_size, holes)
    embed, head, ids, mask, feats = text.embed, text.head, text.ids, text.mask, text.feats
    anchors = [6, 11, 17, 25, 33]
    drafter = DFlashDrafter(ours_config)
    drafter.load_state_dict(state, strict=True)
    frozen = frozen_head(embed, head)
    ids = acceptable_text(drafter, frozen, ids, feats, anchors)
    theirs = nemo.nemo_step(config, state, embed, head, ids, mask, feats, anchors, gamma=GAMMA, sliding_window=window)

    batch = Batch(ids[0], torch.arange(L), mask[0].to(torch.int8), torch.tensor([0, L], dtype=torch.int32), L)
    blocks = lay_out(batch, [np.array(anchors)], drafter.block_size, "cpu")
    value, tally = blocks_loss(drafter, frozen, feats[0], blocks, GAMMA,
                               selector=objective)
    value.backward()
    ours = block_stats(blocks, tally).metrics()
    grads = {n: p.grad for n, p in drafter.named_parameters()}

    worst = max(float((grads[n] - t).abs().max() / t.abs().max().clamp(min=1e-12))
                for n, t in theirs["grads"].items())
    value = value.detach()
    out = {"case": ("holes" if holes else "contiguous") + ("" if window is None else f", window {window}"),
           "loss": round(float(value), 6),
           "nemo_loss": round(theirs["loss"], 6),
           "loss_rel_diff": abs(float(value) - theirs["loss"]) / abs(theirs["loss"]),
           "grads": len(theirs["grads"]), "same_names": set(grads) == set(theirs["grads"]),
           "grad_max_rel_diff": worst, "candidate_recall": ours["candidate_recall"],
           "nemo_candidate_recall": round(theirs["candidate_recall"], 6)}
    if not holes:
        acc = float(tally.correct.sum()) / float(blocks.valid.sum())
        out.update(tau=ours["tau"], nemo_accept_len=theirs["accept_len"], tau_unary=ours["tau_unary"],
                   nemo_base_accept_len=theirs["base_accept_len"], accuracy=round(acc, 6),
                   nemo_accuracy=round(theirs["accuracy"], 6))
    # Decoding's proposal: the walk over the same drafter states and head logits.
    hidden, logits = theirs["hidden"][:, 1:], theirs["logits"][:, 1:]
    anchor_ids = ids[0, torch.tensor(anchors)]
    with torch.no_grad():
        mine = drafter.candidate_selector.walk(hidden, logits, anchor_ids)
    out["walk_equal"] = bool(torch.equal(mine, nemo.nemo_walk(state, config, hidden, logits, anchor_ids)))
    out["ok"] = bool(out["loss_rel_diff"] < RTOL and worst < RTOL and out["same_names"] and out["walk_equal"]
                     and abs(out["candidate_recall"] - out["nemo_candidate_recall"]) < 1e-4
                     and (holes or (abs(out["tau"] - out["nemo_accept_len"]) < 1e-6
                                    and abs(out["tau_unary"] - out["nemo_base_accept_len"]) < 1e-6
                                    and abs(out["accuracy"] - out["nemo_accuracy"]) < 1e-5)))
    return out


def main(argv=None) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    try:
        loaded = nemo.load_nemo()
    except PeerUnavailable as e:
        harness.skipped("parity_dflash2", str(e), args.save)
        return 0
    torch.set_num_threads(1)
    cases = [case(holes=h, window=w) for w in (None, WINDOW) for h in (True, False)]
    line = {"bench": "parity_dflash2", **loaded.record, "torch": torch.__version__,
            "ok": all(c["ok"] for c in cases), "cases": cases}
    harness.emit(line, args.save)
    return 0 if line["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
