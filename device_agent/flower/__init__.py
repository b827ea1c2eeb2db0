"""POET inside Flower, the node's side: a Flower client trains its local model under the schedule the server solved.

The server (host/flower) sends each node a ``poet.v1.Job`` (grouping, schedule, steps, optimizer, lr, seed) and
the torch.export archive in the train message's config; :class:`PoetNode` runs it with the agent's
:class:`~device_agent.agent.jobs.JobRunner` (executor, meters, telemetry) on the node's own dataset, from the
global weights Flower sends, and returns the trained weights and the round's figures. ``plain=True`` trains
the same program with ordinary PyTorch instead. Only the weights and figures leave the node.

Like the rest of device_agent, this imports neither host nor poet_edge: a board installs it without the solver.
"""

from device_agent.flower.node import (
    CONFIG_ARCHIVE,
    CONFIG_JOB,
    CONFIG_PLAIN,
    METRICS,
    PROPERTY_FACTS,
    PROPERTY_RAM_BUDGET,
    FlowerNodeError,
    PoetNode,
    archive_arrays,
)

__all__ = [
    "CONFIG_ARCHIVE",
    "CONFIG_JOB",
    "CONFIG_PLAIN",
    "METRICS",
    "PROPERTY_FACTS",
    "PROPERTY_RAM_BUDGET",
    "FlowerNodeError",
    "PoetNode",
    "archive_arrays",
]
