"""The models: the frozen target's wrapper and self-check (``target``), the demo's tiny
target (``tiny``), the drafter (``drafter``), the DFlash objective (``loss``), the
target's slice a drafter needs (``head``) and the modeling file every exported drafter
carries (``hf_dflash``)."""
