"""Flower's side of a POET node: a NumPyClient to use as is, or to mix into an existing one, and a ClientApp.

A Flower user's existing ClientApp gains POET in a few lines::

    from device_agent.flower import PoetNode
    from device_agent.flower.client import PoetClient

    def client_fn(context):
        node = PoetNode(data_dir="/data", dataset="mine", work_dir="/var/lib/poet", ram_budget="auto")
        return PoetClient(node).to_client()

    app = ClientApp(client_fn=client_fn, mods=[secaggplus_mod])  # SecAgg+ and the DP mods work unchanged

:data:`app` is such a ClientApp configured from the SuperNode's ``--node-config`` (keys in :data:`NODE_CONFIG_KEYS`),
with SecAgg+ whenever the server runs it, and client-side clipping whenever the server wraps its strategy in
Flower's DifferentialPrivacyClientSideFixedClipping.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import fixedclipping_mod, secaggplus_mod
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from device_agent.agent.facts import parse_bytes
from device_agent.flower.node import PoetNode

__all__ = ["NODE_CONFIG_KEYS", "PoetClient", "app", "client_fn", "fixedclipping_when_asked", "node_from_config",
           "secaggplus_when_asked"]

NODE_CONFIG_KEYS = {
    "poet-data-dir": "the directory of the node's datasets (as `poet-agent run --data-dir`)",
    "poet-dataset": "the dataset's name in it",
    "poet-work-dir": "where the node keeps archives, flash pages and run state",
    "poet-platform": "the node's platform name, for the server's cost profile (default: local)",
    "poet-ram-budget": "the node's own RAM budget: bytes, a unit (3MB), a share (40%) or auto (default: the server's)",
    "poet-memory-limit-bytes": "a declared memory limit for an auto budget (as `poet-agent run --memory-limit`)",
    "poet-plain": "true: train with ordinary PyTorch, no schedule",
}


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes")


def node_from_config(node_config: Mapping[str, Any]) -> PoetNode:
    """A :class:`PoetNode` from a SuperNode's ``--node-config`` (ValueError naming a missing key)."""
    missing = [k for k in ("poet-data-dir", "poet-dataset", "poet-work-dir") if not node_config.get(k)]
    if missing:
        described = "; ".join(f"{k}: {NODE_CONFIG_KEYS[k]}" for k in missing)
        raise ValueError(f"the SuperNode's --node-config lacks {', '.join(missing)} ({described})")
    limit = node_config.get("poet-memory-limit-bytes")
    return PoetNode(data_dir=str(node_config["poet-data-dir"]), dataset=str(node_config["poet-dataset"]),
                    work_dir=str(node_config["poet-work-dir"]), platform=str(node_config.get("poet-platform") or "local"),
                    ram_budget=str(node_config.get("poet-ram-budget") or ""),
                    memory_limit_bytes=parse_bytes(limit) if limit not in (None, "", 0) else None,
                    plain=_flag(node_config.get("poet-plain", False)))


class PoetClient(NumPyClient):
    """Answers the server's property query with the node's facts and trains each round with :class:`PoetNode`."""

    def __init__(self, node: PoetNode) -> None:
        self.node = node

    def get_properties(self, config):
        return self.node.properties()

    def fit(self, parameters, config):
        return self.node.fit(parameters, config)


def client_fn(context) -> Any:
    return PoetClient(node_from_config(context.node_config)).to_client()


def secaggplus_when_asked(msg, ctxt, call_next):
    """secaggplus_mod for the train messages of a SecAgg+ workflow; other messages pass straight through.

    Flower's mod assumes every train message belongs to SecAgg+ (it fails on a plain FedAvg round): with this
    one, a server may run with or without secure aggregation against the same nodes.
    """
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)


def fixedclipping_when_asked(msg, ctxt, call_next):
    """fixedclipping_mod (client-side clipping for central DP) when the server's DP wrapper sends a clipping norm.

    Inside the SecAgg+ mod, so the update is clipped before it is quantized and masked (Flower's order).
    """
    try:
        asked = KEY_CLIPPING_NORM in recorddict_compat.recorddict_to_fitins(msg.content, keep_input=True).config
    except (KeyError, TypeError, ValueError):  # not a train message with FitIns (query, SecAgg+ key stages)
        asked = False
    return fixedclipping_mod(msg, ctxt, call_next) if asked else call_next(msg, ctxt)


app = ClientApp(client_fn=client_fn, mods=[secaggplus_when_asked, fixedclipping_when_asked])
