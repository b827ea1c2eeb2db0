"""Python mirror of poet.v1.Schedule (protos/poet/v1/schedule.proto). Convert with device_agent.serde."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

InstructionKind = Literal["compute", "page_out", "page_in", "free"]
Location = Literal["ram", "flash"]
INSTRUCTION_KINDS: tuple[str, ...] = ("compute", "page_out", "page_in", "free")
SCHEDULE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Instruction:
    kind: InstructionKind
    node: int
    location: Location = "ram"  # meaningful for `free` only

    def __str__(self) -> str:
        suffix = f"@{self.location}" if self.kind == "free" else ""
        return f"{self.kind}({self.node}){suffix}"


@dataclass(frozen=True)
class ScheduleNode:
    name: str
    kind: str
    output_bytes: int
    deps: tuple[int, ...]
    workspace_bytes: int = 0  # held only while it is computed: its temporaries beyond inputs and output


@dataclass
class Prediction:
    peak_ram_bytes: float = 0.0
    energy_j: float = 0.0
    compute_j: float = 0.0
    paging_j: float = 0.0
    runtime_s: float = 0.0
    paging_s: float = 0.0
    recomputes: int = 0
    page_ins: int = 0
    page_outs: int = 0


@dataclass
class SolveInfo:
    status: str = ""
    solver: str = ""
    formulation: str = ""
    gap: float = 0.0
    solve_s: float = 0.0


@dataclass
class Schedule:
    graph_name: str
    graph_fingerprint: str
    nodes: list[ScheduleNode]
    instructions: list[Instruction]
    platform: str = ""
    ram_budget_bytes: float = 0.0
    runtime_budget_s: float = 0.0
    fixed_bytes: int = 0
    paging_in_runtime: bool = False
    prediction: Prediction = field(default_factory=Prediction)
    solve: SolveInfo = field(default_factory=SolveInfo)
    format_version: int = SCHEDULE_FORMAT_VERSION

    def counts(self) -> dict[str, int]:
        """Instruction counts: computes, recomputes (computes beyond the first), page-ins, page-outs."""
        computes = sum(1 for ins in self.instructions if ins.kind == "compute")
        return {
            "computes": computes,
            "recomputes": computes - len({ins.node for ins in self.instructions if ins.kind == "compute"}),
            "page_ins": sum(1 for ins in self.instructions if ins.kind == "page_in"),
            "page_outs": sum(1 for ins in self.instructions if ins.kind == "page_out"),
        }
