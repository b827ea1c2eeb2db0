"""One Flower node's round: the server's job run on the node's own data, from the global weights.

The job runs through :class:`~device_agent.agent.jobs.JobRunner`, as a fleet job does: the same archive checks,
executor, energy meter and telemetry events. What Flower adds is handled here: the global weights arrive as
arrays (written into a copy of the archive, so the runner starts from them), the trained weights leave as arrays,
and the round's figures are read from the runner's step events.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import statistics
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from device_agent import protos
from device_agent.agent.datasets import DatasetError, LocalDataset
from device_agent.agent.facts import collect_facts
from device_agent.agent.jobs import _OPTIMIZERS, JobError, JobRunner, _loss_of
from device_agent.agent.program import check_archive, load_module
from device_agent.executor import make_optimizer, plain_train_step
from device_agent.fileio import atomic_write_bytes
from device_agent.meters.memory import PeakRssSampler
from device_agent.meters.registry import default_energy_meter

fleet_pb2 = protos.load("poet.v1.fleet_pb2")

__all__ = ["CONFIG_ARCHIVE", "CONFIG_JOB", "CONFIG_PLAIN", "METRICS", "PROPERTY_FACTS", "PROPERTY_RAM_BUDGET",
           "FlowerNodeError", "PoetNode", "archive_arrays"]

# Keys of the train message's config (server -> node) and of the node's properties (node -> server).
CONFIG_JOB = "poet.job"  # bytes: a serialized poet.v1.Job (grouping, schedule, steps, optimizer, lr, seed)
CONFIG_ARCHIVE = "poet.archive"  # bytes: the torch.export archive (sha256 = the job's model_digest)
CONFIG_PLAIN = "poet.plain"  # bool: train with ordinary PyTorch instead of the schedule
PROPERTY_FACTS = "poet.facts"  # bytes: a serialized poet.v1.RegisterRequest, the facts a fleet agent registers
PROPERTY_RAM_BUDGET = "poet.ram_budget"  # str: the node's own budget (bytes, a unit, a share, auto), or ""
# The figures a node returns per round (Flower metrics). Counts are per training step (every step runs the
# same schedule); energy_j is the round's total; peak_ram_bytes is the executor's tracked peak (the tensors the
# schedule controls; absent for plain training, which tracks nothing); rss_peak_bytes the process's peak RSS.
METRICS = ("mode", "steps", "recomputes", "page_ins", "page_outs", "peak_ram_bytes", "rss_peak_bytes",
           "energy_j", "energy_source", "loss")


class FlowerNodeError(RuntimeError):
    """A round this node cannot run; the message names the problem and the fix."""


def archive_arrays(archive_path: str | Path) -> tuple[list[str], list[np.ndarray]]:
    """The archive's weights (its training program's state_dict) as names and arrays, in the order Flower sends."""
    state = load_module(archive_path).state_dict()
    return list(state), [t.detach().cpu().numpy().copy() for t in state.values()]


class _Telemetry:
    """The runner's telemetry sink for one round: keeps the events in memory (a fleet agent buffers them on disk)."""

    def __init__(self) -> None:
        self.events: list = []

    @property
    def emitted(self) -> int:
        return len(self.events)

    def emit_many(self, events) -> None:
        self.events.extend(events)


class PoetNode:
    """A Flower node that trains under the schedule the server solved for it, on its dataset ``data_dir/dataset``.

    ``work_dir`` holds the cached archive, the flash pages and the runs' state. ``ram_budget`` is what the node
    asks for (e.g. "40%", "3MB", "auto"; "" leaves it to the server); ``memory_limit_bytes`` declares a memory
    limit for an ``auto`` budget (as ``poet-agent run --memory-limit``). ``plain=True`` always trains plainly.
    """

    def __init__(self, *, data_dir: str | Path, dataset: str, work_dir: str | Path, platform: str = "local",
                 ram_budget: str = "", memory_limit_bytes: int | None = None, plain: bool = False,
                 log: Callable[[str], None] | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.dataset = dataset
        self.work_dir = Path(work_dir)
        self.platform = platform
        self.ram_budget = str(ram_budget or "")
        self.memory_limit_bytes = memory_limit_bytes
        self.plain = plain
        self.log = log or (lambda message: None)
        self.flash_dir = self.work_dir / "flash"
        self.state_dir = self.work_dir / "state"
        self.models_dir = self.work_dir / "models"
        for directory in (self.flash_dir, self.state_dir, self.models_dir):
            directory.mkdir(parents=True, exist_ok=True)
        try:
            LocalDataset(self.data_dir, dataset)  # refuse a missing or malformed dataset before any round
        except DatasetError as error:
            raise FlowerNodeError(str(error)) from None

    # ---------------------------------------------------------------------------------------------- properties
    def properties(self) -> dict[str, Any]:
        """What the server plans this node's schedule on: the facts a fleet agent registers, and its budget."""
        facts = collect_facts(platform=self.platform, flash_dir=self.flash_dir,
                              memory_limit_override=self.memory_limit_bytes)
        return {PROPERTY_FACTS: facts.register_request(fleet_pb2).SerializeToString(),
                PROPERTY_RAM_BUDGET: self.ram_budget}

    # ---------------------------------------------------------------------------------------------- a round
    def fit(self, arrays: list[np.ndarray], config: Mapping[str, Any]) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        """Train from the global ``arrays`` as the config's job says; (trained arrays, examples seen, metrics)."""
        if CONFIG_JOB not in config:
            raise FlowerNodeError(f"the train message carries no {CONFIG_JOB!r}: the server must run poet-edge's "
                                  "strategy (host.flower.PoetStrategy) around its Flower strategy")
        try:
            job = fleet_pb2.Job.FromString(bytes(config[CONFIG_JOB]))
        except Exception as error:  # protobuf's DecodeError and friends
            raise FlowerNodeError(f"{CONFIG_JOB!r} is not a poet.v1.Job ({error})") from None
        plain = self.plain or bool(config.get(CONFIG_PLAIN, False))
        archive = self._archive(job, config.get(CONFIG_ARCHIVE))
        job.run_id = f"flower-{uuid.uuid4().hex[:12]}"
        job.kind = fleet_pb2.JOB_KIND_TRAIN
        job.dataset = self.dataset
        job.collect = fleet_pb2.COLLECT_NONE  # the weights are read from the run's directory below
        job.checkpoint_every_steps = job.steps  # one checkpoint at the end: a round is short and is not resumed
        names, _ = archive_arrays(archive)
        start = self.models_dir / f"{job.run_id}.pt2"
        try:
            self._write_with_weights(archive, names, arrays, start)
            if plain:
                trained, metrics = self._train_plain(job, start)
            else:
                if not job.HasField("schedule"):
                    raise FlowerNodeError("the train message's job has no schedule; the server sends one per node "
                                          f"(or {CONFIG_PLAIN!r} for plain training)")
                trained, metrics = self._train_scheduled(job, start)
        except JobError as error:
            raise FlowerNodeError(str(error)) from None
        finally:
            start.unlink(missing_ok=True)
            shutil.rmtree(self.state_dir / "runs" / job.run_id, ignore_errors=True)
        batch_size = int(job.grouping.batch_shape[0])
        return [trained[name].detach().cpu().numpy() for name in names], job.steps * batch_size, metrics

    def _archive(self, job, sent: Any) -> Path:
        """The job's archive: from the message (checked against the job's digest), else from this node's cache."""
        digest = job.model_digest
        if not digest or not all(c in "0123456789abcdef" for c in digest) or len(digest) != 64:
            raise FlowerNodeError(f"the job's model digest {digest[:80]!r} is not a sha256 hex digest")
        path = self.models_dir / f"{digest}.pt2"
        if sent is not None:
            data = bytes(sent)
            if hashlib.sha256(data).hexdigest() != digest:
                raise FlowerNodeError(f"the archive in the train message does not hash to the job's digest {digest}")
            if not path.is_file():
                atomic_write_bytes(path, data)
        if not path.is_file():
            raise FlowerNodeError(f"the train message carries no archive and this node has none cached for {digest}")
        return path

    @staticmethod
    def _write_with_weights(archive: Path, names: list[str], arrays: list[np.ndarray], target: Path) -> None:
        """A copy of ``archive`` whose weights are ``arrays`` (named ``names``), so training starts from them."""
        if len(arrays) != len(names):
            raise FlowerNodeError(f"the server sent {len(arrays)} arrays but the model has {len(names)} weights "
                                  f"({', '.join(names)}); send the arrays of host.flower's initial parameters")
        check_archive(archive)
        exported = torch.export.load(str(archive))
        state = exported.state_dict
        for name, array in zip(names, arrays, strict=True):
            if name not in state:
                raise FlowerNodeError(f"weight {name!r} is not among the archive's parameters and buffers")
            tensor = state[name]
            if tuple(array.shape) != tuple(tensor.shape):
                raise FlowerNodeError(f"weight {name!r}: the server sent shape {tuple(array.shape)}, the model has "
                                      f"{tuple(tensor.shape)}")
            with torch.no_grad():
                tensor.copy_(torch.from_numpy(np.asarray(array)).to(tensor.dtype))
        torch.export.save(exported, str(target))

    def _runner(self) -> JobRunner:
        return JobRunner(flash_dir=self.flash_dir, data_dir=self.data_dir, state_dir=self.state_dir,
                         platform=self.platform, log=self.log)

    def _train_scheduled(self, job, archive: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        telemetry = _Telemetry()
        result = self._runner().run(job, archive, telemetry, threading.Event())
        trained = load_file(str(self.state_dir / "runs" / job.run_id / "weights.safetensors"))
        steps = [e.step for e in telemetry.events if e.WhichOneof("event") == "step"]
        if not steps:
            raise FlowerNodeError("the round ran no step (the job asks for 0 steps?)")
        energies = [s.energy_j for s in steps if s.HasField("energy_j")]
        metrics = {
            "mode": "poet", "steps": len(steps),
            "recomputes": int(steps[-1].recomputes), "page_ins": int(steps[-1].page_ins),
            "page_outs": int(steps[-1].page_outs),
            "peak_ram_bytes": int(max(s.peak_tracked_bytes for s in steps)),
            "rss_peak_bytes": int(max(s.rss_peak_bytes for s in steps)),
            "energy_source": result.measured.energy_source or steps[-1].energy_source,
            "loss": float(statistics.fmean(result.loss_per_step)),
        }
        if energies:
            metrics["energy_j"] = float(sum(energies))
        return trained, metrics

    def _train_plain(self, job, archive: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Ordinary PyTorch on the same program, batches and seed as the runner's (its VERIFY reference)."""
        module = load_module(archive)
        try:
            dataset = LocalDataset(self.data_dir, self.dataset)
        except DatasetError as error:
            raise FlowerNodeError(str(error)) from None
        batch_size = int(job.grouping.batch_shape[0])
        optimizer = make_optimizer(_OPTIMIZERS.get(job.optimizer, "sgd"),
                                   [p for p in module.parameters() if p.requires_grad], job.lr)
        losses: list[float] = []
        torch.manual_seed(job.seed)
        meter = default_energy_meter()
        try:
            with PeakRssSampler() as rss:
                start = meter.read()
                for batch in dataset.batches(batch_size, job.seed, count=job.steps):
                    x, y = JobRunner._tensors(batch, job.grouping)
                    losses.append(plain_train_step(lambda *inputs, y=y: module(*inputs, labels=y), _loss_of, (x,), y,
                                                   optimizer))
                energy_j, _ = meter.energy_j(start, meter.read())
            source = meter.source  # after the reads: a measured meter lost meanwhile says it fell back to the model
        finally:
            getattr(meter, "close", lambda: None)()  # the modelled meter holds nothing to close
        if not all(math.isfinite(loss) for loss in losses):
            raise FlowerNodeError(f"training diverged: losses {losses}; lower the learning rate")
        metrics = {"mode": "plain", "steps": len(losses), "recomputes": 0, "page_ins": 0, "page_outs": 0,
                   "rss_peak_bytes": int(rss.peak_bytes), "energy_j": float(energy_j), "energy_source": source,
                   "loss": float(statistics.fmean(losses))}
        return {name: t.detach().clone() for name, t in module.state_dict().items()}, metrics
