"""The run, in the launching process: what is checked before anything spawns
(``preflight``), the run directory (``rundir``), how the stages are wired
(``wiring``), the job itself (``job``), the fork server it starts first, while the
preflight runs (``forkserver``), and the single-process reference trainer that is the
pipeline's oracle (``reference``).
"""
