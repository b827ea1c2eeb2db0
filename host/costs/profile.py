"""Platform profiles: the device constants that turn a TrainingGraph into seconds and joules.

A profile is a JSON file (schema below). The shipped ones live in ``host/costs/profiles/``; a user
profile (e.g. written by ``poet profile --local``) is any path ending in ``.json``.

Schema (version 1), units in every key::

    {
      "schema_version": 1,
      "name": "a72",
      "description": "...",
      "compute": {
        "flops_per_s": {"default": 2.0e9, "matmul": ...},   # op_class -> FLOP/s, "default" required
        "energy_per_flop_j": 2.49e-08,                       # optional: J per FLOP (else time x power)
        "compute_power_w": 3.0
      },
      "page_in":  {"latency_s": ..., "throughput_bytes_per_s": ...},
      "page_out": {"latency_s": ..., "throughput_bytes_per_s": ...},   # each may add "compute_thread_s" (below)
      "memory_power_w": 0.15,
      "board_power_w": 3.0,
      "bytes_per_element": 4,
      "energy_source": "modelled:poet2022-constants",
      "sources": {"compute.flops_per_s.default": "...", ...}   # optional: dotted field -> provenance
    }

Optional, written by a calibration (``host/calibrate/fit.py``); absent, a profile prices as the paper does::

    "compute": {
      "bwd_flops_per_s": {"matmul": ...},           # backward nodes' rates (else the forward ones)
      "node_overhead_s": {"fwd": ..., "bwd": ...},  # seconds per node compute (the executor's call)
      "class_node_overhead_s": {"fwd": {"conv": ...}, "bwd": {...}},  # plus this per compute of a class's node
                                                    # (a kernel's fixed cost: a small conv is far from its FLOP rate)
      "class_seconds_per_byte": {"fwd": {"conv": ...}, "bwd": {...}},  # plus this per byte of a class's node
                                                    # traffic (a conv's time follows its tensors more than its FLOPs)
      "op_overhead_s": {"fwd": ..., "bwd": ...},    # seconds per aten op a node runs (dispatch)
      "memory_bytes_per_s": {"fwd": ..., "bwd": ...}  # a node's output + input bytes at this rate
    },
    "step": {"optimizer_bytes_per_s": ..., "optimizer_overhead_s": ...,  # an optimizer step: a fixed cost,
             "optimizer_tensor_overhead_s": ...,    # one per parameter tensor (its Python loop), the bytes
             "instruction_overhead_s": ..., "step_overhead_s": ...,
             "free_ram_s": ..., "free_flash_s": ...,
             "transfer_overlap": ...},                # share of a page transfer's time hidden behind compute,
                                                    # 0 to 1 (absent: 1, an I/O thread with a core of its own)
    "idle_power_w": ...                             # drawn outside computes and transfers (metered)
    "page_in": {..., "compute_thread_s": ...}       # seconds a transfer holds the compute thread besides its own
    "page_out": {..., "compute_thread_s": ...}      # time on the I/O thread (never hidden behind compute)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from device_agent.errors import UserError
from device_agent.fileio import atomic_write_text

SCHEMA_VERSION = 1
OP_CLASSES: tuple[str, ...] = ("input", "matmul", "conv", "norm", "elementwise", "pool", "loss", "other")
DEFAULT_OP_CLASS = "default"

_PROFILES_PACKAGE = "host.costs"
_PROFILES_DIR = "profiles"


class ProfileError(UserError, ValueError):
    """A profile that cannot be loaded or saved; the message names the file, the field and the expected unit."""


class UnknownPlatformError(ProfileError):
    """A platform name that is neither a shipped profile nor a path to a .json file."""


@dataclass(frozen=True)
class PlatformProfile:
    """Device constants (seconds, joules, watts, bytes). ``path`` is where it was loaded from, if anywhere."""

    name: str
    description: str
    flops_per_s: dict[str, float]  # op_class -> FLOP/s; always has "default"
    energy_per_flop_j: float | None  # None: compute energy = compute time x compute_power_w
    compute_power_w: float
    page_in_latency_s: float
    page_in_throughput_bytes_per_s: float
    page_out_latency_s: float
    page_out_throughput_bytes_per_s: float
    memory_power_w: float  # drawn while paging (in or out)
    board_power_w: float  # whole board while training
    bytes_per_element: int
    energy_source: str  # "modelled:..." or "measured:..."
    sources: dict[str, str] = field(default_factory=dict)  # dotted field path -> provenance
    path: str | None = None
    # Optional, fitted from telemetry (host/calibrate): what the paper's model lacks. Absent, a profile
    # prices as the paper does (backward at forward rates, no per-node or per-step overheads).
    bwd_flops_per_s: dict[str, float] | None = None  # op_class -> FLOP/s of backward nodes
    fwd_node_overhead_s: float = 0.0  # fixed seconds per fwd/loss compute (the executor's call of a node)
    bwd_node_overhead_s: float = 0.0  # fixed seconds per bwd compute
    fwd_op_overhead_s: float = 0.0  # fixed seconds per aten op of a fwd/loss compute (dispatch)
    bwd_op_overhead_s: float = 0.0  # fixed seconds per aten op of a bwd compute
    class_node_overhead_s: dict[str, dict[str, float]] | None = None  # "fwd"|"bwd" -> op_class -> fixed seconds
    # per compute of a node of that class, on top of the direction's node overhead
    # "fwd"|"bwd" -> op_class -> seconds per byte of the node's traffic, on top of the direction's memory rate
    class_seconds_per_byte: dict[str, dict[str, float]] | None = None
    fwd_memory_bytes_per_s: float | None = None  # a fwd/loss compute's output and input bytes move at this rate
    bwd_memory_bytes_per_s: float | None = None  # the same for a bwd compute
    optimizer_bytes_per_s: float | None = None  # optimizer step throughput over trainable parameter bytes
    optimizer_overhead_s: float = 0.0  # fixed seconds per optimizer step
    optimizer_tensor_overhead_s: float = 0.0  # seconds per trainable parameter tensor per optimizer step
    instruction_overhead_s: float = 0.0  # executor seconds per instruction outside computes and transfers
    step_overhead_s: float = 0.0  # executor seconds per step outside instructions and the optimizer
    free_ram_s: float = 0.0  # seconds to drop a tensor from RAM
    free_flash_s: float = 0.0  # seconds to delete a page file
    transfer_overlap: float = 1.0  # share of a page transfer's time that runs behind compute (1: the I/O thread
    # has a core of its own; less where it shares the compute's core or the interpreter lock)
    idle_power_w: float | None = None  # drawn outside computes and transfers (a meter's fit)
    # seconds of the compute thread a transfer takes besides its own time on the I/O thread (starting it, taking
    # its result): added to the transfer's price, and never hidden behind compute
    page_in_compute_thread_s: float = 0.0
    page_out_compute_thread_s: float = 0.0

    def flops_per_s_for(self, op_class: str, kind: str = "fwd") -> float:
        """Throughput for ``op_class`` (of a ``kind`` fwd/loss/bwd node), falling back to the "default" entry."""
        if kind == "bwd" and self.bwd_flops_per_s:
            rates = self.bwd_flops_per_s
            return rates.get(op_class, rates.get(DEFAULT_OP_CLASS, self.flops_per_s_for(op_class)))
        return self.flops_per_s.get(op_class, self.flops_per_s[DEFAULT_OP_CLASS])

    def node_overhead_s_for(self, kind: str, op_count: int = 1, op_class: str | None = None) -> float:
        """Fixed seconds of one compute of a ``kind`` node of ``op_class`` running ``op_count`` aten ops."""
        direction = "bwd" if kind == "bwd" else "fwd"
        class_s = (self.class_node_overhead_s or {}).get(direction, {}).get(op_class, 0.0)
        if direction == "bwd":
            return self.bwd_node_overhead_s + op_count * self.bwd_op_overhead_s + class_s
        return self.fwd_node_overhead_s + op_count * self.fwd_op_overhead_s + class_s

    def optimizer_step_s(self, param_bytes: int, param_tensors: int) -> float:
        """Seconds of one optimizer step over ``param_tensors`` trainable tensors of ``param_bytes`` in all: a fixed
        cost, one per tensor (the optimizer's loop over them) and the bytes at its throughput (0 where unpriced)."""
        seconds = self.optimizer_overhead_s + param_tensors * self.optimizer_tensor_overhead_s
        if self.optimizer_bytes_per_s:
            seconds += param_bytes / self.optimizer_bytes_per_s
        return seconds

    def class_seconds_per_byte_for(self, kind: str, op_class: str) -> float:
        """Seconds per traffic byte that a ``kind`` node of ``op_class`` pays on top of its direction's memory rate."""
        direction = "bwd" if kind == "bwd" else "fwd"
        return (self.class_seconds_per_byte or {}).get(direction, {}).get(op_class, 0.0)

    def memory_bytes_per_s_for(self, kind: str) -> float | None:
        """Rate at which a ``kind`` node's tensors move through memory; None: not priced."""
        return self.bwd_memory_bytes_per_s if kind == "bwd" else self.fwd_memory_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (see the module docstring); ``path`` is not part of it."""
        compute: dict[str, Any] = {"flops_per_s": dict(self.flops_per_s)}
        if self.energy_per_flop_j is not None:
            compute["energy_per_flop_j"] = self.energy_per_flop_j
        compute["compute_power_w"] = self.compute_power_w
        if self.bwd_flops_per_s:
            compute["bwd_flops_per_s"] = dict(self.bwd_flops_per_s)
        if self.fwd_node_overhead_s or self.bwd_node_overhead_s:
            compute["node_overhead_s"] = {"fwd": self.fwd_node_overhead_s, "bwd": self.bwd_node_overhead_s}
        if self.fwd_op_overhead_s or self.bwd_op_overhead_s:
            compute["op_overhead_s"] = {"fwd": self.fwd_op_overhead_s, "bwd": self.bwd_op_overhead_s}
        if self.class_node_overhead_s:
            compute["class_node_overhead_s"] = {kind: dict(values) for kind, values in self.class_node_overhead_s.items()}
        if self.class_seconds_per_byte:
            compute["class_seconds_per_byte"] = {kind: dict(values) for kind, values in self.class_seconds_per_byte.items()}
        rates = {kind: rate for kind, rate in (("fwd", self.fwd_memory_bytes_per_s),
                                               ("bwd", self.bwd_memory_bytes_per_s)) if rate is not None}
        if rates:
            compute["memory_bytes_per_s"] = rates
        step = {}
        if self.optimizer_bytes_per_s is not None:
            step["optimizer_bytes_per_s"] = self.optimizer_bytes_per_s
        for key in _STEP_SECONDS_KEYS:
            if getattr(self, key):
                step[key] = getattr(self, key)
        if self.transfer_overlap != 1.0:
            step["transfer_overlap"] = self.transfer_overlap
        extra: dict[str, Any] = {"step": step} if step else {}
        if self.idle_power_w is not None:
            extra["idle_power_w"] = self.idle_power_w
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "description": self.description,
            "compute": compute,
            "page_in": {
                "latency_s": self.page_in_latency_s,
                "throughput_bytes_per_s": self.page_in_throughput_bytes_per_s,
                **({"compute_thread_s": self.page_in_compute_thread_s} if self.page_in_compute_thread_s else {}),
            },
            "page_out": {
                "latency_s": self.page_out_latency_s,
                "throughput_bytes_per_s": self.page_out_throughput_bytes_per_s,
                **({"compute_thread_s": self.page_out_compute_thread_s} if self.page_out_compute_thread_s else {}),
            },
            "memory_power_w": self.memory_power_w,
            "board_power_w": self.board_power_w,
            "bytes_per_element": self.bytes_per_element,
            "energy_source": self.energy_source,
            **extra,
            "sources": dict(self.sources),
        }

    @classmethod
    def from_dict(cls, data: Any, *, file_label: str = "<profile>", path: str | None = None) -> PlatformProfile:
        """Validate ``data`` (parsed JSON); errors name ``file_label`` and the offending field."""
        return _Validator(file_label).profile(data, path)


# --------------------------------------------------------------------------- validation
_TOP_KEYS = (
    "schema_version",
    "name",
    "description",
    "compute",
    "page_in",
    "page_out",
    "memory_power_w",
    "board_power_w",
    "bytes_per_element",
    "energy_source",
    "step",
    "idle_power_w",
    "sources",
)
_COMPUTE_KEYS = ("flops_per_s", "energy_per_flop_j", "compute_power_w", "bwd_flops_per_s", "node_overhead_s",
                 "op_overhead_s", "memory_bytes_per_s", "class_node_overhead_s", "class_seconds_per_byte")
_STEP_SECONDS_KEYS = ("optimizer_overhead_s", "optimizer_tensor_overhead_s", "instruction_overhead_s", "step_overhead_s",
                      "free_ram_s", "free_flash_s")
_STEP_KEYS = ("optimizer_bytes_per_s", *_STEP_SECONDS_KEYS, "transfer_overlap")
_PAGE_KEYS = ("latency_s", "throughput_bytes_per_s")
_PAGE_OPTIONAL_KEYS = ("compute_thread_s",)
_EXPECTED = {  # what a required field must hold, for error messages
    "schema_version": f"the integer {SCHEMA_VERSION}",
    "name": "a non-empty string",
    "compute": "a JSON object with flops_per_s and compute_power_w",
    "compute.flops_per_s": "a JSON object of op_class -> FLOP per second, with a 'default' entry",
    "compute.flops_per_s.default": "a positive number in FLOP per second",
    "compute.compute_power_w": "a positive number in watts",
    "page_in": "a JSON object with latency_s and throughput_bytes_per_s",
    "page_out": "a JSON object with latency_s and throughput_bytes_per_s",
    "page_in.latency_s": "a non-negative number in seconds",
    "page_out.latency_s": "a non-negative number in seconds",
    "page_in.throughput_bytes_per_s": "a positive number in bytes per second",
    "page_out.throughput_bytes_per_s": "a positive number in bytes per second",
    "memory_power_w": "a non-negative number in watts",
    "board_power_w": "a positive number in watts",
    "bytes_per_element": "a positive integer in bytes",
    "energy_source": "a string starting with 'modelled:' or 'measured:'",
}


def known_field_paths(flops_classes: tuple[str, ...] = (DEFAULT_OP_CLASS, *OP_CLASSES)) -> tuple[str, ...]:
    """Every dotted field path a ``sources`` entry may describe."""
    paths = ["name", "description", "energy_source", "memory_power_w", "board_power_w", "bytes_per_element"]
    paths += ["compute.flops_per_s", "compute.energy_per_flop_j", "compute.compute_power_w"]
    paths += [f"compute.flops_per_s.{c}" for c in flops_classes]
    paths += [f"{block}.{key}" for block in ("page_in", "page_out") for key in (*_PAGE_KEYS, *_PAGE_OPTIONAL_KEYS)]
    paths += ["compute.bwd_flops_per_s", *(f"compute.bwd_flops_per_s.{c}" for c in flops_classes)]
    for key in ("node_overhead_s", "op_overhead_s", "memory_bytes_per_s", "class_node_overhead_s",
                "class_seconds_per_byte"):
        paths += [f"compute.{key}", f"compute.{key}.fwd", f"compute.{key}.bwd"]
    paths += ["step", *(f"step.{key}" for key in _STEP_KEYS), "idle_power_w"]
    return tuple(paths)


class _Validator:
    def __init__(self, file_label: str):
        self.file_label = file_label

    def fail(self, message: str) -> ProfileError:
        return ProfileError(f"{self.file_label}: {message}")

    def _object(self, data: Any, where: str, allowed: tuple[str, ...], required: tuple[str, ...]) -> dict:
        label = f"field {where!r}" if where else "the top level"
        if not isinstance(data, dict):
            raise self.fail(f"{label} must be a JSON object, got {type(data).__name__}")
        unknown = [key for key in data if key not in allowed]
        if unknown:
            prefix = f"{where}." if where else ""
            names = ", ".join(repr(prefix + str(key)) for key in unknown)
            raise self.fail(f"unknown field(s) {names}; allowed in {label}: {', '.join(allowed)}")
        for key in required:
            if key not in data:
                dotted = f"{where}.{key}" if where else key
                raise self.fail(f"missing required field {dotted!r}: expected {_EXPECTED[dotted]}")
        return data

    def _number(self, value: Any, where: str, unit: str, *, positive: bool) -> float:
        sign = "positive" if positive else "non-negative"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            ok = ok and math.isfinite(value)
        except OverflowError:  # an integer beyond float range
            ok = False
        if not ok or (value <= 0 if positive else value < 0):
            raise self.fail(f"field {where!r} must be a {sign} number in {unit}, got {value!r}")
        return float(value)

    def _string(self, value: Any, where: str, *, nonempty: bool = False) -> str:
        if not isinstance(value, str) or (nonempty and not value.strip()):
            kind = "a non-empty string" if nonempty else "a string"
            raise self.fail(f"field {where!r} must be {kind}, got {value!r}")
        return value

    def _page(self, data: Any, block: str) -> tuple[float, float, float]:
        data = self._object(data, block, (*_PAGE_KEYS, *_PAGE_OPTIONAL_KEYS), _PAGE_KEYS)
        latency_s = self._number(data["latency_s"], f"{block}.latency_s", "seconds", positive=False)
        throughput = self._number(
            data["throughput_bytes_per_s"], f"{block}.throughput_bytes_per_s", "bytes per second", positive=True
        )
        compute_thread_s = self._number(data.get("compute_thread_s", 0.0), f"{block}.compute_thread_s", "seconds",
                                        positive=False)
        return latency_s, throughput, compute_thread_s

    def profile(self, data: Any, path: str | None) -> PlatformProfile:
        required = tuple(k for k in _TOP_KEYS if k not in ("description", "sources", "step", "idle_power_w"))
        data = self._object(data, "", _TOP_KEYS, required)
        version = data["schema_version"]
        if not isinstance(version, int) or isinstance(version, bool) or version != SCHEMA_VERSION:
            raise self.fail(f"field 'schema_version' must be the integer {SCHEMA_VERSION}, got {version!r}")
        name = self._string(data["name"], "name", nonempty=True)
        description = self._string(data.get("description", ""), "description")

        compute = self._object(data["compute"], "compute", _COMPUTE_KEYS, ("flops_per_s", "compute_power_w"))
        rates = self._object(
            compute["flops_per_s"], "compute.flops_per_s", (DEFAULT_OP_CLASS, *OP_CLASSES), (DEFAULT_OP_CLASS,)
        )
        flops_per_s = {
            op_class: self._number(rate, f"compute.flops_per_s.{op_class}", "FLOP per second", positive=True)
            for op_class, rate in rates.items()
        }
        energy_per_flop_j = compute.get("energy_per_flop_j")
        if energy_per_flop_j is not None:
            energy_per_flop_j = self._number(
                energy_per_flop_j, "compute.energy_per_flop_j", "joules per FLOP (or null)", positive=True
            )
        compute_power_w = self._number(compute["compute_power_w"], "compute.compute_power_w", "watts", positive=True)
        bwd_flops_per_s = None
        if compute.get("bwd_flops_per_s") is not None:
            bwd_rates = self._object(compute["bwd_flops_per_s"], "compute.bwd_flops_per_s",
                                     (DEFAULT_OP_CLASS, *OP_CLASSES), ())
            bwd_flops_per_s = {
                op_class: self._number(rate, f"compute.bwd_flops_per_s.{op_class}", "FLOP per second", positive=True)
                for op_class, rate in bwd_rates.items()
            }
        def per_direction(key: str, unit: str, positive: bool) -> dict[str, float]:
            values = self._object(compute.get(key, {}), f"compute.{key}", ("fwd", "bwd"), ())
            return {kind: self._number(value, f"compute.{key}.{kind}", unit, positive=positive)
                    for kind, value in values.items()}

        node_overhead_s = per_direction("node_overhead_s", "seconds", False)
        op_overhead_s = per_direction("op_overhead_s", "seconds", False)
        memory_bytes_per_s = per_direction("memory_bytes_per_s", "bytes per second", True)

        def per_class(key: str, unit: str) -> dict[str, dict[str, float]] | None:
            if compute.get(key) is None:
                return None
            by_direction = self._object(compute[key], f"compute.{key}", ("fwd", "bwd"), ())
            return {
                kind: {op_class: self._number(value, f"compute.{key}.{kind}.{op_class}", unit, positive=False)
                       for op_class, value in self._object(values, f"compute.{key}.{kind}",
                                                           (DEFAULT_OP_CLASS, *OP_CLASSES), ()).items()}
                for kind, values in by_direction.items()}

        class_node_overhead_s = per_class("class_node_overhead_s", "seconds")
        class_seconds_per_byte = per_class("class_seconds_per_byte", "seconds per byte")
        step = self._object(data.get("step", {}), "step", _STEP_KEYS, ())
        optimizer_bytes_per_s = (
            self._number(step["optimizer_bytes_per_s"], "step.optimizer_bytes_per_s", "bytes per second", positive=True)
            if step.get("optimizer_bytes_per_s") is not None else None
        )
        step_seconds = {key: self._number(step.get(key, 0.0), f"step.{key}", "seconds", positive=False)
                        for key in _STEP_SECONDS_KEYS}
        transfer_overlap = step.get("transfer_overlap", 1.0)
        if (not isinstance(transfer_overlap, (int, float)) or isinstance(transfer_overlap, bool)
                or not 0.0 <= transfer_overlap <= 1.0):  # NaN fails the comparison too
            raise self.fail("field 'step.transfer_overlap' must be a share from 0 to 1 (the part of a page "
                            f"transfer's time hidden behind compute), got {transfer_overlap!r}")
        transfer_overlap = float(transfer_overlap)
        idle_power_w = (self._number(data["idle_power_w"], "idle_power_w", "watts", positive=False)
                        if data.get("idle_power_w") is not None else None)

        page_in_latency_s, page_in_throughput, page_in_compute_thread_s = self._page(data["page_in"], "page_in")
        page_out_latency_s, page_out_throughput, page_out_compute_thread_s = self._page(data["page_out"], "page_out")
        memory_power_w = self._number(data["memory_power_w"], "memory_power_w", "watts", positive=False)
        board_power_w = self._number(data["board_power_w"], "board_power_w", "watts", positive=True)

        bytes_per_element = data["bytes_per_element"]
        if not isinstance(bytes_per_element, int) or isinstance(bytes_per_element, bool) or bytes_per_element <= 0:
            raise self.fail(f"field 'bytes_per_element' must be a positive integer in bytes, got {bytes_per_element!r}")
        energy_source = self._string(data["energy_source"], "energy_source", nonempty=True)
        if not energy_source.startswith(("modelled:", "measured:")):
            raise self.fail(f"field 'energy_source' must start with 'modelled:' or 'measured:', got {energy_source!r}")

        sources_raw = data.get("sources", {})
        if not isinstance(sources_raw, dict):
            raise self.fail(f"field 'sources' must be a JSON object of dotted field -> text, got {sources_raw!r}")
        known = known_field_paths()
        sources: dict[str, str] = {}
        for key, text in sources_raw.items():
            if key not in known:
                raise self.fail(f"field 'sources' has an entry for unknown field {key!r}; known: {', '.join(known)}")
            sources[key] = self._string(text, f"sources.{key}")

        return PlatformProfile(
            name=name,
            description=description,
            flops_per_s=flops_per_s,
            energy_per_flop_j=energy_per_flop_j,
            compute_power_w=compute_power_w,
            page_in_latency_s=page_in_latency_s,
            page_in_throughput_bytes_per_s=page_in_throughput,
            page_out_latency_s=page_out_latency_s,
            page_out_throughput_bytes_per_s=page_out_throughput,
            memory_power_w=memory_power_w,
            board_power_w=board_power_w,
            bytes_per_element=bytes_per_element,
            energy_source=energy_source,
            sources=sources,
            path=path,
            bwd_flops_per_s=bwd_flops_per_s,
            fwd_node_overhead_s=node_overhead_s.get("fwd", 0.0),
            bwd_node_overhead_s=node_overhead_s.get("bwd", 0.0),
            fwd_op_overhead_s=op_overhead_s.get("fwd", 0.0),
            bwd_op_overhead_s=op_overhead_s.get("bwd", 0.0),
            class_node_overhead_s=class_node_overhead_s,
            class_seconds_per_byte=class_seconds_per_byte,
            fwd_memory_bytes_per_s=memory_bytes_per_s.get("fwd"),
            bwd_memory_bytes_per_s=memory_bytes_per_s.get("bwd"),
            optimizer_bytes_per_s=optimizer_bytes_per_s,
            **step_seconds,
            transfer_overlap=transfer_overlap,
            idle_power_w=idle_power_w,
            page_in_compute_thread_s=page_in_compute_thread_s,
            page_out_compute_thread_s=page_out_compute_thread_s,
        )


# --------------------------------------------------------------------------- loading and saving
def _shipped_dir():
    return resources.files(_PROFILES_PACKAGE).joinpath(_PROFILES_DIR)


def list_platforms() -> list[str]:
    """Names of the shipped profiles, sorted."""
    return sorted(entry.name[: -len(".json")] for entry in _shipped_dir().iterdir() if entry.name.endswith(".json"))


def _parse(text: str, file_label: str, path: str | None) -> PlatformProfile:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ProfileError(
            f"{file_label}: invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None
    return PlatformProfile.from_dict(data, file_label=file_label, path=path)


def _looks_like_path(name_or_path: str) -> bool:
    return name_or_path.endswith(".json") or os.sep in name_or_path or (os.altsep or os.sep) in name_or_path


def load_profile(name_or_path: str) -> PlatformProfile:
    """Load a shipped profile by name (see :func:`list_platforms`) or a profile file by path (``*.json``)."""
    name_or_path = os.fspath(name_or_path)
    if not _looks_like_path(name_or_path):
        platforms = list_platforms()
        if name_or_path not in platforms:
            raise UnknownPlatformError(
                f"unknown platform {name_or_path!r}; valid names: {', '.join(platforms)} "
                "(or give a path to a profile .json file)"
            )
        resource = _shipped_dir().joinpath(f"{name_or_path}.json")
        profile = _parse(resource.read_text(encoding="utf-8"), f"{name_or_path}.json", str(resource))
        if profile.name != name_or_path:
            raise ProfileError(f"{name_or_path}.json: field 'name' must be {name_or_path!r}, got {profile.name!r}")
        return profile
    path = Path(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(
            f"{name_or_path}: profile file not found (shipped platforms: {', '.join(list_platforms())})"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ProfileError(f"{name_or_path}: cannot read profile file: {error}") from None
    return _parse(text, name_or_path, str(path))


def save_profile(profile: PlatformProfile, path: str | os.PathLike) -> None:
    """Validate and write ``profile`` as JSON atomically (see device_agent.fileio)."""
    target = Path(path)
    data = profile.to_dict()
    PlatformProfile.from_dict(data, file_label=str(target))  # never write a file that would not load
    directory = target.parent if str(target.parent) else Path(".")
    if not directory.is_dir():
        raise ProfileError(f"{target}: directory {str(directory)!r} does not exist; create it first")
    text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    try:  # keep an existing file's permissions; a new file gets rw-r--r--
        mode = target.stat().st_mode & 0o777
    except OSError:
        mode = 0o644
    atomic_write_text(target, text, mode=mode)
