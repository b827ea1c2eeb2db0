"""POET inside Flower: the demo and the loopback deployment it runs on (``python -m poet_edge.flower.demo``).

The pieces a Flower user takes are :mod:`device_agent.flower` (the node) and :mod:`host.flower` (the strategy).
"""
