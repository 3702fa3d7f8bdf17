"""Shared state and math of training, below the processes that use it: the batch schedule,
the one owner of batch-id arithmetic (``schedule``), and a run sized to a number of steps
(``sizing``); shared weights and gradient sums
(``params``); the drafter's step in micro-batches (``drafter_step``); the step math
(``optim``); metric tables (``metrics``); checkpoints (``checkpoint``); the feature cache
(``feature_cache``); simulated compute (``simulate``); the cost model (``costmodel``); and
the memory plan (``memplan``: what each process holds, ``memparts``, from ``memtrace``'s
traces, kept by ``tracecache``).
"""
