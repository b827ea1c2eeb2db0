"""Runs a Schedule on a real model: the RAM tensor store, the flash page store, exact backward.

Rooms: plan.py (the schedule checked and annotated before training), executor.py (the runtime),
node_functions.py (a node's forward and backward functions), aten_calls.py and inductor.py (those
functions as plain Python calls, or through inductor's kernels), lowering.py (the straight-line program),
saved.py (where each saved tensor lives until its backward), results.py (what a step reports),
ram_store.py and page_store.py (the stores), telemetry.py, reference.py (plain PyTorch training, the
optimizers and their state, the parameters' comparison), errors.py.
"""

from device_agent.executor.errors import BudgetExceededError, ExecutorError, InvalidScheduleError, MissingTensorError
from device_agent.executor.executor import Counters, ScheduleExecutor, StepResult
from device_agent.executor.page_store import (
    FlashDirError,
    FlashFullError,
    FlashPageStore,
    FlashSpaceError,
    PageCorruptError,
    PageStoreError,
    StalePageDir,
    check_flash_dir,
    check_flash_space,
    remove_stale_page_dirs,
)
from device_agent.executor.partition import NodeProgram, Partition, PartitionNode
from device_agent.executor.plan import check_schedule, planned_counts
from device_agent.executor.ram_store import Entry, EntryBuilder, RamStore, TensorView
from device_agent.executor.reference import (
    OPTIMIZER_STATE,
    OPTIMIZERS,
    OptimizerState,
    make_optimizer,
    parameter_differences,
    plain_train_step,
)
from device_agent.executor.telemetry import (
    EventStream,
    InstructionEvent,
    JsonLinesWriter,
    StepSummary,
    StepTotals,
)
from device_agent.replay import ScheduleMismatchError

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
    "FlashSpaceError",
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
    "StepTotals",
    "TensorView",
    "check_flash_dir",
    "check_flash_space",
    "OPTIMIZERS",
    "OPTIMIZER_STATE",
    "OptimizerState",
    "check_schedule",
    "make_optimizer",
    "parameter_differences",
    "plain_train_step",
    "planned_counts",
    "remove_stale_page_dirs",
]
