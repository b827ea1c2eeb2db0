"""Runs a Schedule on a real model: the RAM tensor store, the flash page store, exact backward."""

from device_agent.executor.executor import (
    BudgetExceededError,
    Counters,
    ExecutorError,
    InvalidScheduleError,
    MissingTensorError,
    ScheduleExecutor,
    ScheduleMismatchError,
    StepResult,
    check_schedule,
    plain_train_step,
    planned_counts,
)
from device_agent.executor.page_store import (
    FlashDirError,
    FlashFullError,
    FlashPageStore,
    PageCorruptError,
    PageStoreError,
    StalePageDir,
    check_flash_dir,
    remove_stale_page_dirs,
)
from device_agent.executor.partition import NodeProgram, Partition, PartitionNode
from device_agent.executor.ram_store import Entry, EntryBuilder, RamStore, TensorView
from device_agent.executor.telemetry import EventStream, InstructionEvent, JsonLinesWriter, StepSummary

__all__ = [
    "BudgetExceededError",
    "Counters",
    "Entry",
    "EntryBuilder",
    "EventStream",
    "ExecutorError",
    "FlashDirError",
    "FlashFullError",
    "FlashPageStore",
    "InstructionEvent",
    "InvalidScheduleError",
    "JsonLinesWriter",
    "MissingTensorError",
    "NodeProgram",
    "PageCorruptError",
    "PageStoreError",
    "Partition",
    "PartitionNode",
    "RamStore",
    "ScheduleExecutor",
    "ScheduleMismatchError",
    "StepResult",
    "StalePageDir",
    "StepSummary",
    "TensorView",
    "check_flash_dir",
    "check_schedule",
    "plain_train_step",
    "planned_counts",
    "remove_stale_page_dirs",
]
