"""Marks a drafter module puts on its own parameters for the optimizer to read
(``train.optim``): the step sees tensors, not names, so what a parameter is must travel
on the tensor. Here, below ``train``, so that the modules that own the parameters can set
them."""

from __future__ import annotations

import torch

OFF_MUON = "keeps_off_muon"
"""The attribute that marks a 2-D parameter Muon leaves to AdamW (``keep_off_muon``)."""


def keep_off_muon(*params: torch.Tensor) -> None:
    """Mark embedding-like tables (a row per token, read by lookup) for AdamW: Muon
    orthogonalises a layer's map, which a table of independent rows is not. A module
    that builds its parameters on the meta device and then ``to_empty`` gets new
    tensor objects, so it marks them again after ``_apply`` (``CandidateSelector``)."""
    for p in params:
        setattr(p, OFF_MUON, True)
