"""POET inside Flower, the server's side: :class:`PoetStrategy` wraps a Flower strategy and solves per node.

The node's side is :mod:`device_agent.flower`; :mod:`host.flower.app` is a ready ServerApp (FedAvg, SecAgg+).
"""

from host.flower.strategy import PoetStrategy, StrategyConfigError, parse_budget

__all__ = ["PoetStrategy", "StrategyConfigError", "parse_budget"]
