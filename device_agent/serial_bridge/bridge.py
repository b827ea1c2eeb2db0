"""`poet-agent bridge`: a microcontroller on a serial line, presented to the coordinator as one more agent.

The bridge is the agent (device_agent/agent/client.py: registration, heartbeats, long polls, the durable
telemetry buffer, results) with a job runner that trains on the board instead of in this process. It registers
the board's activation arena, flash and platform; for each job it maps the received model onto the firmware's
layers, sends the weights, the schedule and each step's batch (read from this machine's data dir: the data stays
on the board's side of the network), turns the board's per-instruction events into the fleet's telemetry, and
reads the trained parameters back. The board trains with the fleet's one SGD (make_optimizer: the job's lr,
momentum 0.9), as VERIFY's plain reference does on this machine.

A board that reboots mid-job is detected by its session id: on the same line the link raises BoardResetError; a
line that closes with it (QEMU restarted, a USB board re-enumerated) is reopened and the new session tells. The
job then starts again from its initial weights (at most MAX_BOARD_RESETS times), and the steps it re-runs send
their events again (the coordinator keeps the later copy).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from device_agent import protos
from device_agent.agent.facts import BoardFacts, MemoryLimit, agent_version
from device_agent.agent.jobs import JobCancelled, JobError, JobRunner, _Run
from device_agent.agent.program import load_program
from device_agent.serde import schedule_from_proto
from device_agent.serial_bridge.model import load_parameters, mcu_model, parameter_tensors

fleet_pb2 = protos.load("poet.v1.fleet_pb2")
schedule_pb2 = protos.load("poet.v1.schedule_pb2")

DEFAULT_PLATFORM = "m4"
MAX_BOARD_RESETS = 3  # per job: a board that keeps rebooting fails the job with the reason
DEFAULT_RECONNECT_TIMEOUT_S = 30.0  # how long a job waits for a board whose line broke to answer again
RECONNECT_PAUSE_S = 0.5
_KIND_NAMES = {schedule_pb2.INSTRUCTION_KIND_COMPUTE: "compute", schedule_pb2.INSTRUCTION_KIND_PAGE_OUT: "page_out",
               schedule_pb2.INSTRUCTION_KIND_PAGE_IN: "page_in", schedule_pb2.INSTRUCTION_KIND_FREE: "free"}


def timing_source(info) -> str:
    """The telemetry's timing label: empty for a board's own clock, ``emulated:qemu-BOARD`` under QEMU."""
    return f"emulated:qemu-{info.board}" if info.emulated else ""


def board_facts(info, *, platform: str = DEFAULT_PLATFORM) -> BoardFacts:
    """What the bridge registers: the microcontroller's memory and flash (McuBoardInfo), not this machine's."""
    total = int(info.arena_bytes + info.param_bytes)
    return BoardFacts(
        platform=platform, ram_total_bytes=total, ram_available_bytes=total,
        memory_limit=MemoryLimit(int(info.arena_bytes), "the microcontroller's activation arena"),
        flash_capacity_bytes=int(info.flash_bytes), flash_free_bytes=int(info.flash_bytes), cpu_count=1,
        torch_version=f"firmware protocol {info.protocol_version}", meters=(),
        runtime_rss_bytes=0, agent_version=agent_version(), activation_arena_bytes=int(info.arena_bytes),
        board=info.board)


def step_telemetry(job, schedule, step: int, events, done, info, *, unix_time_s: float) -> list:
    """The fleet's TelemetryEvents for one board step: one per instruction, then the step's summary."""
    seconds_per_tick = 1.0 / float(info.tick_hz)
    timing = timing_source(info)
    out, computed, compute_s, paging_s, recomputes = [], set(), 0.0, 0.0, 0
    for event in events:
        instruction = schedule.instructions[event.position]
        node = schedule.nodes[event.node]
        kind = _KIND_NAMES.get(event.kind, "")
        duration_s = event.ticks * seconds_per_tick
        recompute = kind == "compute" and event.node in computed
        if kind == "compute":
            computed.add(event.node)
            compute_s += duration_s
            recomputes += recompute
        elif kind in ("page_in", "page_out"):
            paging_s += duration_s
        location = {"ram": schedule_pb2.LOCATION_RAM, "flash": schedule_pb2.LOCATION_FLASH}.get(
            instruction.location or "", schedule_pb2.LOCATION_UNSPECIFIED)
        out.append(fleet_pb2.TelemetryEvent(job_id=job.job_id, unix_time_s=unix_time_s, instruction=(
            fleet_pb2.InstructionTelemetry(
                step=step, position=event.position, kind=event.kind, node=event.node, node_name=node.name,
                node_kind=node.kind, location=location, duration_s=duration_s, bytes_moved=event.bytes_moved,
                ram_in_use_bytes=event.arena_in_use_bytes, recompute=recompute, timing_source=timing))))
    out.append(fleet_pb2.TelemetryEvent(job_id=job.job_id, unix_time_s=unix_time_s, step=fleet_pb2.StepTelemetry(
        step=step, duration_s=done.ticks * seconds_per_tick, loss=done.loss,
        peak_tracked_bytes=done.arena_high_water_bytes, ram_budget_bytes=schedule.ram_budget_bytes,
        fixed_bytes=schedule.fixed_bytes, computes=done.computes, recomputes=recomputes, page_ins=done.page_ins,
        page_outs=done.page_outs, frees=done.frees, bytes_paged_out=done.bytes_paged_out,
        bytes_paged_in=done.bytes_paged_in, compute_s=compute_s, paging_s=paging_s, timing_source=timing)))
    return out


class McuJobRunner(JobRunner):
    """Runs TRAIN and VERIFY jobs on the microcontroller.

    ``connect()`` opens a fresh session with the board and returns (McuBoard, McuBoardInfo); the runner closes
    each session's link when it is done with it. A line that breaks mid-job (QEMU restarted, a USB board
    re-enumerated) is reopened for up to ``reconnect_timeout_s``; a board that answers with a new session id was
    reset, and the job starts again from its initial weights (at most MAX_BOARD_RESETS times)."""

    def __init__(self, connect: Callable[[], tuple], *, data_dir: Path, state_dir: Path,
                 platform: str = DEFAULT_PLATFORM, log: Callable[[str], None] = lambda message: None,
                 reconnect_timeout_s: float = DEFAULT_RECONNECT_TIMEOUT_S) -> None:
        super().__init__(flash_dir=Path(state_dir), data_dir=data_dir, state_dir=state_dir, platform=platform,
                         log=log)
        self._connect = connect
        self.reconnect_timeout_s = float(reconnect_timeout_s)
        self.session_id: int | None = None  # the board's session at the last hello: another one means a reset

    def _profile(self, job, result) -> None:
        raise JobError("a microcontroller runs no PROFILE job: it is priced on its platform profile "
                       f"({self.platform}); submit TRAIN or VERIFY jobs")

    def _open(self, cancel) -> tuple:
        """A new session with the board, retrying a line that is down; BoardResetError when the board
        answers with a session other than the one it had (it rebooted since)."""
        from device_agent.serial_bridge.link import BoardResetError, LinkError

        deadline = time.monotonic() + self.reconnect_timeout_s
        while True:
            try:
                board, info = self._connect()
                break
            except (LinkError, OSError) as error:
                if time.monotonic() > deadline:
                    raise JobError(f"the board did not answer for {self.reconnect_timeout_s:g} s ({error}); check "
                                   "its power and the serial line") from None
                if cancel.wait(RECONNECT_PAUSE_S):
                    raise JobCancelled("stopped while reconnecting to the board") from None
        previous, self.session_id = self.session_id, int(info.session_id)
        if previous is not None and previous != info.session_id:
            board.link.close()
            raise BoardResetError(f"the board on {board.link.name} answers with session {info.session_id:#010x} "
                                  f"instead of {previous:#010x}: it rebooted")
        return board, info

    def _train(self, job, model_path: Path, telemetry, cancel, progress, result) -> None:
        from device_agent.executor import make_optimizer
        from device_agent.serial_bridge.board import McuBoardError, McuProtocolError
        from device_agent.serial_bridge.link import BoardResetError, LinkError
        from device_agent.serial_bridge.model import McuModelError

        if job.optimizer not in (fleet_pb2.OPTIMIZER_UNSPECIFIED, fleet_pb2.OPTIMIZER_SGD):
            raise JobError("the firmware trains with SGD only; submit the run with --optimizer sgd")
        schedule = schedule_from_proto(job.schedule)
        loaded = load_program(model_path, job.grouping, schedule)
        module = loaded.module
        # the fleet's one SGD (lr, momentum), as the plain reference of a VERIFY job trains it
        sgd = make_optimizer("sgd", [torch.zeros(1, requires_grad=True)], job.lr).param_groups[0]
        try:
            program = mcu_model(module, job.grouping, schedule, learning_rate=sgd["lr"], momentum=sgd["momentum"])
        except McuModelError as error:
            raise JobError(str(error)) from None
        dataset, batch_size = self._dataset(job)
        if batch_size != program.model.batch_size:
            raise JobError(f"the schedule was solved for batch {program.model.batch_size}, the job asks for "
                           f"{batch_size}")
        heldout = dataset.heldout()
        run = _Run(self.state_dir, job.run_id)
        accuracy_before = self._accuracy(module, loaded.spec.loss_value, heldout, job.grouping, batch_size)
        initial = [(layer, tensor, values.clone()) for layer, tensor, values in parameter_tensors(module, program)]
        run.save_weights("initial.safetensors", module)
        resets = 0
        while True:
            board = None
            meta = {"step": 0, "losses": [], "step_s": [], "energy_j": [], "peak_bytes": 0,
                    "accuracy_before": accuracy_before}
            walls, link_bytes, resent = [], [], 0
            try:
                board, info = self._open(cancel)
                board.load_model(program.model)
                board.load_schedule(job.schedule)
                board.write_params(initial)
                step = 0
                for batch in dataset.batches(batch_size, job.seed, start_index=0, count=job.steps):
                    if cancel.is_set():
                        raise JobCancelled(f"run {job.run_id} stopped at step {step}; it starts again from its "
                                           "initial weights")
                    x, y = self._tensors(batch, job.grouping)
                    step += 1
                    before, started = board.link.counters, time.monotonic()
                    events, done = board.run_step(step, x.to(torch.float32), y)
                    after = board.link.counters
                    walls.append(time.monotonic() - started)
                    link_bytes.append(after.bytes_written - before.bytes_written + after.bytes_read - before.bytes_read)
                    resent += after.frames_retransmitted - before.frames_retransmitted
                    telemetry.emit_many(step_telemetry(job, schedule, step, events, done, info,
                                                       unix_time_s=time.time()))
                    meta["losses"].append(float(done.loss))
                    meta["step_s"].append(done.ticks / float(info.tick_hz))
                    meta["energy_j"].append(None)
                    meta["peak_bytes"] = max(meta["peak_bytes"], int(done.arena_high_water_bytes))
                    if progress is not None:
                        progress(step)
                load_parameters(module, program, board.read_params())
                break
            except (McuBoardError, McuProtocolError) as error:
                raise JobError(str(error)) from None
            except LinkError as error:
                cause = error
            finally:
                if board is not None:
                    board.link.close()
            if not isinstance(cause, BoardResetError):
                # the line broke: whether the board rebooted behind it shows in its session once it answers again
                self.log(f"the link to the board broke during run {job.run_id} ({cause}); reconnecting")
                try:
                    self._open(cancel)[0].link.close()
                except BoardResetError as error:
                    cause = error
            resets += 1
            if resets > MAX_BOARD_RESETS:
                raise JobError(f"the board reset or lost its line {resets} times during the job ({cause}); check "
                               "its power and the serial line")
            self.log(f"the board was reset or lost its line during run {job.run_id} after step "
                     f"{len(meta['losses'])} ({type(cause).__name__}: {cause}); starting the job again from its "
                     "initial weights")
        if walls:
            self.log(f"run {job.run_id}: {len(walls)} steps on {info.board}, {statistics.median(walls):.3f} s wall "
                     f"per step through the bridge (median), {statistics.median(link_bytes):.0f} bytes over the link "
                     f"per step (median, both ways, framing included), {resent} frames resent by this host")
        self._finish_training(job, model_path, run, module, loaded.spec.loss_value, meta, dataset, heldout,
                              batch_size, "sgd", "", result)
        result.measured.energy_source = ""


__all__ = ["DEFAULT_PLATFORM", "McuJobRunner", "board_facts", "step_telemetry", "timing_source"]
