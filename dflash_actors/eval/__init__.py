"""How good a drafter is: greedy speculative decoding and its baselines (``decode``),
simulated and real tau (``tau``), the parity report of ``launch.py evaluate``
(``parity``), the periodic evaluator process (``evaluator``), and ``launch.py prepare``,
the target's own text for training (``prepare``).
"""
