"""Shared state and math of training, below the processes that use it: the batch
schedule (the one owner of batch-id arithmetic), shared weights and gradient sums
(``params``), the step math (``optim``), metric tables, checkpoints, simulated compute
and the cost model.
"""
