"""Shared state and math of training, below the processes that use it: the batch
schedule (the one owner of batch-id arithmetic), shared weights and gradient sums
(``params``), the drafter's step in micro-batches (``drafter_step``), the step math
(``optim``), metric tables, checkpoints, the feature cache, simulated compute, the cost
model, and the memory plan (``memplan``, from ``memtrace``'s traces).
"""
