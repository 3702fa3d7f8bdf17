"""What a run tells the person watching it: ``status.json`` (its one schema, ``status``),
metrics and the console while it runs (``monitor``), the summary at the end
(``report``), ``launch.py status`` (``statusview``) and ``launch.py plot`` (``plot``).
"""
