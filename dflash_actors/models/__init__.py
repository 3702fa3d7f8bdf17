"""The models: the frozen target's wrapper (``target``), where its files are (``target_dir``:
an HF directory, ``pkg:NAME``, GGUF converted once), its self-check (``self_check``), its
tensor-parallel gang (``tensor_parallel``) and the weights its actors share
(``shared_weights``), the demo's tiny target (``tiny``), the drafter (``drafter``: its
config, layers and export) and where a run's drafter starts (``drafter_start``:
``init_from``, the target's layers, the mask token),
DFlash2's convolution and selector (``dflash2``), DSpark's Markov and confidence heads
(``dspark``), XPress's causal refiner head and Jacobi rounds (``xpress``), the marks a
drafter's modules put on their parameters for the optimizer (``marks``: Muon's token
tables), the DFlash objective (``loss``) over the
block layout (``blocks``: anchors, visibility, the forward over blocks) and its vocabulary
head's cross-entropy (``head_loss``), the target's slice a drafter needs
(``head``), and the modeling file every exported DFlash drafter carries (``hf_dflash``).

No circle: ``target`` imports ``target_dir``, ``tiny`` and ``tensor_parallel``; they
import ``target_dir`` and ``self_check``, never ``target``."""
