"""What a board sends, checked at the door: facts at Register, telemetry batches and results.

A board holds a valid certificate, but what it says is data from outside: every number is range-checked,
every string bounded, and a result is checked against the job it answers before anything is stored. Each
check raises BoardInputError naming the field, the value's problem and the fix; the coordinator answers
INVALID_ARGUMENT with it and stores nothing.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

from host.fleet.limits import (
    MAX_CPU_COUNT,
    MAX_DATASETS,
    MAX_ERROR_CHARS,
    MAX_EVENT_BYTES,
    MAX_EVENTS_PER_BATCH,
    MAX_EVENTS_PER_RUN,
    MAX_FACT_BYTES,
    MAX_FACT_CHARS,
    MAX_METERS,
    MAX_SAMPLE_DIM,
    MAX_SAMPLE_DIMS,
    MAX_SEQ,
)

__all__ = ["BoardInputError", "bounded_error", "check_facts", "check_result", "check_telemetry_batch",
           "first_non_finite"]

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_BYTE_FACTS = ("ram_total_bytes", "ram_available_bytes", "memory_limit_bytes", "flash_capacity_bytes",
               "flash_free_bytes", "runtime_rss_bytes", "activation_arena_bytes")
_TEXT_FACTS = ("platform", "torch_version", "agent_version", "board")


class BoardInputError(ValueError):
    """A value a board sent is out of range or malformed."""


def check_facts(facts: dict[str, Any]) -> dict[str, Any]:
    """``facts`` (serde.facts_from_register) if every one is in range; BoardInputError otherwise."""
    for name in _BYTE_FACTS:
        value = int(facts.get(name) or 0)
        if value > MAX_FACT_BYTES:
            raise BoardInputError(f"{name} = {value} is over {MAX_FACT_BYTES} bytes (1 PiB): report the board's "
                                  "real figure (0 when unknown)")
    if int(facts.get("cpu_count") or 0) > MAX_CPU_COUNT:
        raise BoardInputError(f"cpu_count = {facts['cpu_count']} is over {MAX_CPU_COUNT}")
    available, total = int(facts.get("ram_available_bytes") or 0), int(facts.get("ram_total_bytes") or 0)
    if total and available > total:
        raise BoardInputError(f"ram_available_bytes = {available} is more than ram_total_bytes = {total}")
    for name in _TEXT_FACTS:
        _check_text(name, facts.get(name) or "")
    meters = list(facts.get("meters") or [])
    if len(meters) > MAX_METERS:
        raise BoardInputError(f"{len(meters)} meters reported; at most {MAX_METERS}")
    for meter in meters:
        _check_text("a meter name", meter)
    datasets = list(facts.get("datasets") or [])
    if len(datasets) > MAX_DATASETS:
        raise BoardInputError(f"{len(datasets)} datasets reported; at most {MAX_DATASETS}")
    for dataset in datasets:
        _check_dataset(dataset)
    return facts


def _check_dataset(dataset: dict[str, Any]) -> None:
    from device_agent.agent.datasets import DatasetError, check_dataset_name

    try:
        check_dataset_name(dataset["name"])
    except DatasetError as error:
        raise BoardInputError(f"a reported dataset: {error}") from None
    shape = dataset["item_shape"]
    if len(shape) > MAX_SAMPLE_DIMS or not all(0 < d < MAX_SAMPLE_DIM for d in shape):
        raise BoardInputError(f"dataset {dataset['name']!r}: item shape {shape} needs at most {MAX_SAMPLE_DIMS} "
                              f"dimensions, each in [1, {MAX_SAMPLE_DIM})")
    if dataset["item_count"] > MAX_FACT_BYTES or dataset["classes"] >= MAX_SAMPLE_DIM:
        raise BoardInputError(f"dataset {dataset['name']!r}: {dataset['item_count']} items or {dataset['classes']} "
                              "classes is out of range")


def check_result(result, *, steps: int, collect: str) -> None:
    """A RunResult against the job it answers (``steps``, ``collect``); BoardInputError at the first problem."""
    losses = list(result.loss_per_step)
    if len(losses) > steps:
        raise BoardInputError(f"loss_per_step has {len(losses)} losses for a job of {steps} steps")
    for name, low, high in (("accuracy_before", 0.0, 1.0), ("accuracy_after", 0.0, 1.0),
                            ("max_rel_param_diff", 0.0, math.inf)):
        if result.HasField(name):
            value = getattr(result, name)
            # +inf is a real VERIFY answer (a tensor plain training left at zero differs): stored as null
            if math.isnan(value) or not low <= value <= high or (value == math.inf and high != math.inf):
                raise BoardInputError(f"{name} = {value} is outside [{low:g}, {high:g}]")
    if result.HasField("measured"):
        measured = result.measured
        values = [measured.step_s, measured.peak_ram_bytes] + ([measured.energy_j]
                                                              if measured.HasField("energy_j") else [])
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise BoardInputError(f"measured figures must be finite and not negative, not {values}")
        _check_text("measured.energy_source", measured.energy_source)
    if result.events_emitted > MAX_EVENTS_PER_RUN:
        raise BoardInputError(f"events_emitted = {result.events_emitted} is over {MAX_EVENTS_PER_RUN}")
    if result.param_digest and not _SHA256_HEX.fullmatch(result.param_digest):
        raise BoardInputError("param_digest is not a sha256 in lower-case hex")
    if result.HasField("weights"):
        _check_weights(result.weights, collect)


def check_telemetry_batch(batch) -> None:
    """A TelemetryBatch: at most MAX_EVENTS_PER_BATCH events, each of at most MAX_EVENT_BYTES, with a seq in
    1..MAX_SEQ; BoardInputError otherwise (nothing of the batch is stored)."""
    if len(batch.events) > MAX_EVENTS_PER_BATCH:
        raise BoardInputError(f"a telemetry batch of {len(batch.events)} events; at most {MAX_EVENTS_PER_BATCH} "
                              "per batch")
    for event in batch.events:
        if not 1 <= event.seq <= MAX_SEQ:
            raise BoardInputError(f"telemetry seq {event.seq} is outside 1..{MAX_SEQ}")
        size = event.ByteSize()
        if size > MAX_EVENT_BYTES:
            raise BoardInputError(f"telemetry event seq {event.seq} is {size} bytes; at most {MAX_EVENT_BYTES}")


def bounded_error(text: str) -> str:
    """A result's error line, cut to MAX_ERROR_CHARS (saying how much was cut)."""
    if len(text) <= MAX_ERROR_CHARS:
        return text
    return f"{text[:MAX_ERROR_CHARS]}... ({len(text) - MAX_ERROR_CHARS} more characters cut by the coordinator)"


def _check_weights(weights, collect: str) -> None:
    data = weights.safetensors
    if collect == "none":
        raise BoardInputError("the job collects no weights (collect none), but the result carries "
                              f"{len(data)} bytes of them")
    if not data:
        raise BoardInputError("weights are announced but carry no data (uploads are not supported yet)")
    if not _SHA256_HEX.fullmatch(weights.digest or ""):
        raise BoardInputError("weights.digest must be the sha256 of the safetensors file, in lower-case hex")
    if weights.size_bytes and weights.size_bytes != len(data):
        raise BoardInputError(f"weights.size_bytes = {weights.size_bytes}, but {len(data)} bytes came")
    if hashlib.sha256(data).hexdigest() != weights.digest:
        return  # a transfer error: the caller answers DATA_LOSS (resend), not a refusal
    try:
        from safetensors import deserialize

        deserialize(bytes(data))  # the header and every tensor's extent, for every dtype (bf16 too)
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types for every malformation
        raise BoardInputError(f"the weights are not a safetensors file ({type(error).__name__}: {error}); "
                              "send what safetensors.torch.save writes") from None


def first_non_finite(values) -> int | None:
    """The position of the first NaN or infinity in ``values`` (a loss that diverged), None if all are finite."""
    return next((position for position, value in enumerate(values) if not math.isfinite(value)), None)


def _check_text(name: str, text: str) -> None:
    if len(text) > MAX_FACT_CHARS:
        raise BoardInputError(f"{name} is {len(text)} characters long; at most {MAX_FACT_CHARS}")
    if any(ord(c) < 32 for c in text):
        raise BoardInputError(f"{name} contains control characters")
