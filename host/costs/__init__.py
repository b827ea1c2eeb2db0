"""Costs: platform profiles (device constants) and pricing of a TrainingGraph into seconds and joules.

``host.costs.local_bench`` (imports torch) is not re-exported; import it explicitly.
"""

from host.costs.priced_graph import PricedGraph
from host.costs.pricing import price_graph
from host.costs.profile import (
    PlatformProfile,
    ProfileError,
    UnknownPlatformError,
    list_platforms,
    load_profile,
    save_profile,
)

__all__ = [
    "PlatformProfile",
    "PricedGraph",
    "ProfileError",
    "UnknownPlatformError",
    "list_platforms",
    "load_profile",
    "price_graph",
    "save_profile",
]
