"""Operator tools on top of the job: the chaos driver (``chaos``), ``--topology auto``'s
advice (``advice``) and ``launch.py taps``, the ranking of target-layer sets by short runs
(``taps``).
"""
