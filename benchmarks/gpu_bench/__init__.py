"""What ``benchmarks/gpu_check.sh`` measures on a lent GPU, one subcommand per section.

    python -m benchmarks.gpu_bench env            # versions, device, /dev/shm, disk
    python -m benchmarks.gpu_bench prepare        # 2c's target saved, 2c's plan (2b and 2c read it)
    python -m benchmarks.gpu_bench tiny           # 3: tiny 2-2 over the CUDA feature ring vs the reference
    python -m benchmarks.gpu_bench nodes          # 3: two nodes over loopback
    python -m benchmarks.gpu_bench target         # 2a: target forward, Qwen3-8B shape, bf16
    python -m benchmarks.gpu_bench drafter        # 2b: drafter step at the memory plan's micro-batch
    python -m benchmarks.gpu_bench pipeline       # 2c: launch.py 1-1 on cuda:0, to steady steps
    python -m benchmarks.gpu_bench serving        # prepare --server against vLLM (skips without it)
    python -m benchmarks.gpu_bench collect WORK   # the final {"check": "gpu_check", ...} line

Each measuring subcommand prints one JSON line and, with ``--out FILE``, writes it there
too, rewritten as each part finishes: a section that runs out of time still leaves the
parts it finished. Launch logs and plans go to ``--work`` (``$WORK``). ``--smoke`` runs
the same code on CPU with tiny shapes (hidden 64, 6 layers, vocab 256, 2 x 64 tokens),
so that the paths are exercised where no GPU is; its numbers mean nothing.

Choices, and why:
  * 2a and 2b build Qwen3-8B-shaped modules directly on the device with random weights
    (nothing to download; seconds, not minutes): speed does not depend on the values.
  * 2b builds only the target's ``embed_tokens`` and ``lm_head`` (bf16, frozen, the
    modules ``TargetModel`` hands the loss) instead of the whole target, and trains
    through ``drafter_step`` at the micro-batch (``train.drafter_block_tokens``) and
    checkpointing that ``launch.py --plan-only`` chooses for the pipeline's run (2c) on
    this GPU: 2b is 2c's drafter step alone, and its peak memory is set beside the
    plan's for ``drafter.0``.
  * 2c is one run, sized to reach steady steps in about 200 s: the 8B-shaped 5-layer
    drafter of 2b (its compiled kernels are then warm), a target of Qwen3-8B's shape cut
    to ``PIPE_TARGET_LAYERS`` layers (7 GB instead of 16: quicker to save and load;
    the drafter's work does not depend on the target's depth), loaded by the target
    itself (``target.share_weights=off``: no 7 GB copy into /dev/shm), 4 threads an
    actor, and everything else as the plan places it (feature ring, optimizer): the
    product's own choices on this GPU. The CUDA feature ring across processes is
    ``tiny``'s to check. ``prepare`` saves the target and makes the plan while the
    first sections run, so that 2c's time goes to the run.
  * Where a run has a plan (tiny, 2b, 2c), each process's planned peak per device is set
    beside what it measured (``status.json``'s ``gpu_peak_mb``, ``max_memory_allocated``
    on its device; the plan's figure includes a CUDA context that this does not).
  * FLOPs come from ``costmodel`` (the counts the run summaries use for MFU): matmuls
    ``2 * weights * tokens``, causal attention over half a row on average, drafter
    forward+backward as 3x forward. The target counts only layers ``0..max(layer_ids)``:
    ``TargetModel.hidden`` stops the forward after the deepest selected layer. Recomputed
    work (checkpointed cross-entropy chunks or layers) is not counted, as usual for MFU.
  * MFU is achieved TFLOP/s over the device's bf16 dense peak (``monitor.PEAK_TFLOPS``;
    989 for an H200, also the fallback for a device not in that table). SpecForge
    reports about 44% trainer MFU on an H200; the drafter numbers are set beside it.
  * The pipeline's steady rate is read from ``metrics.jsonl``: tokens of the steps after
    the first two (start-up, flex_attention compilation) over the time they took. Run
    summaries' tokens/s divide by the whole wall time, model loading and the final
    checkpoint included, and are reported too.

Layout: ``common`` (shapes, the JSON line, timing, memory, devices), ``flops`` (FLOPs and
MFU), ``launches`` (``launch.py`` runs, their plans, steady rates), then one module per
section: ``env``, ``pipeline`` (its ``prepare`` too), ``tiny``, ``nodes``, ``target``,
``drafter``, ``serving``, ``collect``; ``__main__`` is the command line.
"""
