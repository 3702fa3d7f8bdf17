"""Several machines: which node this is (``node``), what the optimizer and the node's
link share (``exchange``), and the link thread between supervisors (``link``).
"""
