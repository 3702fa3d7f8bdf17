"""Operator tools on top of the job: the chaos driver (``chaos``) and ``--topology
auto``'s advice (``advice``).
"""
