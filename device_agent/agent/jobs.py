"""Run one fleet job on the board: TRAIN, VERIFY or PROFILE, with checkpoints, resume and local results.

TRAIN loads the received model (:mod:`device_agent.agent.program`), reads batches from the board's own
dataset, and trains under the job's schedule with paging to ``flash_dir``. Every executor event goes to the
run's durable telemetry buffer, once per step (one transaction). Every K steps the run is checkpointed
atomically (parameters, buffers, optimizer state, RNG state, data position, losses so far) in
``STATE_DIR/runs/RUN_ID/``; a runner called again for the same run resumes there, and its final parameters
equal those of an uninterrupted run (each step depends only on the checkpointed state).
Steps re-run after a resume emit their events again, with new sequence numbers.

The trained weights stay on the board (``weights.safetensors`` in the run directory); the result carries
metrics, a digest of the parameters, and the weights or their delta only when the job asks.
VERIFY also trains the same model plainly from the same weights and batches and reports the largest
relative parameter difference. PROFILE measures the board (:mod:`device_agent.profiling`).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from device_agent import protos
from device_agent.agent.datasets import SYNTHETIC_DATASET, Batch, DatasetError, LocalDataset, SyntheticDataset
from device_agent.agent.program import load_module, load_program
from device_agent.executor import ScheduleExecutor, make_optimizer, parameter_differences, plain_train_step
from device_agent.executor.telemetry import EventStream
from device_agent.fileio import atomic_write_bytes
from device_agent.meters.memory import RssSampler
from device_agent.meters.registry import default_energy_meter
from device_agent.profiling import profile_local_machine
from device_agent.serde import rss_event_to_proto, schedule_from_proto, telemetry_event_to_proto

fleet_pb2 = protos.load("poet.v1.fleet_pb2")

__all__ = ["DEFAULT_CHECKPOINT_EVERY_STEPS", "JobCancelled", "JobError", "JobRunner", "param_digest"]

DEFAULT_CHECKPOINT_EVERY_STEPS = 10
MAX_INLINE_WEIGHTS_BYTES = 6 * 1024 * 1024  # below the coordinator's 8 MiB message bound
_CHECKPOINT_TENSORS = "checkpoint.safetensors"
_CHECKPOINT_META = "checkpoint.json"  # older releases: the metadata beside the tensors (read, never written)
_CHECKPOINT_KEY = "poet_checkpoint"  # the safetensors header entry holding the checkpoint's metadata (JSON)
_OPTIMIZERS = {fleet_pb2.OPTIMIZER_SGD: "sgd", fleet_pb2.OPTIMIZER_ADAMW: "adamw",
               fleet_pb2.OPTIMIZER_UNSPECIFIED: "sgd"}


class JobError(RuntimeError):
    """A job that cannot run on this board; the message names the problem and the fix."""


class JobCancelled(JobError):
    """The coordinator (or a signal) stopped the job; its last checkpoint stays for a resume."""


def param_digest(module: torch.nn.Module) -> str:
    """sha256 over the parameters in name order: name, dtype, shape and raw bytes."""
    digest = hashlib.sha256()
    for name, param in sorted(module.named_parameters()):
        tensor = param.detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _state_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers as independent contiguous tensors (tied weights saved once per name)."""
    return {name: t.detach().clone().contiguous() for name, t in module.state_dict().items()}


class _Run:
    """The files of one run on the board: checkpoint, initial and final weights, kept in its directory."""

    def __init__(self, state_dir: Path, run_id: str) -> None:
        if not run_id or "/" in run_id or run_id.startswith("."):
            raise JobError(f"run id {run_id!r} is not a plain name")
        self.dir = Path(state_dir) / "runs" / run_id
        self.dir.mkdir(parents=True, exist_ok=True)

    def save_checkpoint(self, module, optimizer, step: int, data_index: int, meta: dict) -> None:
        tensors = {f"model/{k}": v for k, v in _state_tensors(module).items()}
        optimizer_state = optimizer.state_dict()
        entries = []
        for index, state in optimizer_state["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{index}/{key}"] = value.detach().clone().contiguous()
                    entries.append([index, key, "tensor"])
                else:
                    entries.append([index, key, value])
        tensors["rng/cpu"] = torch.get_rng_state()
        # One file, written atomically: the step's metadata rides in the safetensors header, so a kill -9 at any
        # moment leaves the previous checkpoint or this one, never a mix (two files written in turn could be
        # caught between the writes, and the resume then started over from step 0).
        record = {**meta, "step": step, "data_index": data_index, "optimizer_entries": entries,
                  "param_groups": optimizer_state["param_groups"]}
        atomic_write_bytes(self.dir / _CHECKPOINT_TENSORS, save(tensors, metadata={_CHECKPOINT_KEY: json.dumps(record)}))
        (self.dir / _CHECKPOINT_META).unlink(missing_ok=True)  # a checkpoint an older release wrote in two files

    def load_checkpoint(self, module, optimizer) -> dict | None:
        meta_path, tensor_path = self.dir / _CHECKPOINT_META, self.dir / _CHECKPOINT_TENSORS
        if not tensor_path.is_file():
            return None
        with safe_open(str(tensor_path), "pt") as opened:
            header = opened.metadata() or {}
        tensors = load_file(str(tensor_path))
        if _CHECKPOINT_KEY in header:
            meta = json.loads(header[_CHECKPOINT_KEY])
        elif meta_path.is_file():  # an older release's two files: usable when both name the same step
            meta = json.loads(meta_path.read_text())
            if int(tensors["meta/step"][0]) != meta["step"]:
                return None
        else:
            return None
        module.load_state_dict({k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")})
        state: dict = {}
        for index, key, value in meta["optimizer_entries"]:
            state.setdefault(int(index), {})[key] = tensors[f"optim/{index}/{key}"] if value == "tensor" else value
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        torch.set_rng_state(tensors["rng/cpu"])
        return meta

    def save_weights(self, name: str, module) -> tuple[bytes, str]:
        data = save(_state_tensors(module))
        atomic_write_bytes(self.dir / name, data)
        return data, hashlib.sha256(data).hexdigest()


class JobRunner:
    """Runs jobs on this board against its flash, data and state directories."""

    def __init__(self, *, flash_dir: Path, data_dir: Path, state_dir: Path, platform: str = "local",
                 log: Callable[[str], None] = lambda message: None, quick_profile: bool = False,
                 return_freed_memory: bool = False) -> None:
        self.flash_dir = Path(flash_dir)
        # Under an enforced memory cgroup, freed tensors go back to the OS at once (RSS follows the schedule);
        # otherwise the agent keeps them for reuse, as `poet train` does (faster, steadier step times).
        self.return_freed_memory = return_freed_memory
        self.data_dir = Path(data_dir)
        self.state_dir = Path(state_dir)
        self.platform = platform
        self.log = log
        self.quick_profile = quick_profile  # PROFILE jobs measure for a few seconds instead of ~30 (tests)

    # ------------------------------------------------------------------------------ entry point
    def run(self, job, model_path: Path | None, telemetry, cancel: threading.Event,
            progress: Callable[[int], None] | None = None):
        """Run ``job`` to its end (or to a cancel, raising JobCancelled) and return its RunResult."""
        result = fleet_pb2.RunResult(job_id=job.job_id, run_id=job.run_id, status=fleet_pb2.RUN_STATUS_DONE)
        if job.kind == fleet_pb2.JOB_KIND_PROFILE:
            self._profile(job, result)
        elif job.kind in (fleet_pb2.JOB_KIND_TRAIN, fleet_pb2.JOB_KIND_VERIFY):
            if model_path is None:
                raise JobError("a training job needs its model archive")
            self._train(job, Path(model_path), telemetry, cancel, progress, result)
        else:
            raise JobError(f"unknown job kind {job.kind}; this agent runs TRAIN, VERIFY and PROFILE")
        result.events_emitted = telemetry.emitted
        return result

    # ------------------------------------------------------------------------------ PROFILE
    def _profile(self, job, result) -> None:
        fields = profile_local_machine(str(self.flash_dir), name=self.platform, quick=self.quick_profile,
                                       progress=self.log)
        result.profile_json = json.dumps(fields)

    # ------------------------------------------------------------------------------ TRAIN / VERIFY
    def _train(self, job, model_path: Path, telemetry, cancel, progress, result) -> None:
        schedule = schedule_from_proto(job.schedule)
        loaded = load_program(model_path, job.grouping, schedule)
        dataset, batch_size = self._dataset(job)
        run = _Run(self.state_dir, job.run_id)
        module = loaded.module
        optimizer_name = _OPTIMIZERS.get(job.optimizer, "sgd")
        optimizer = make_optimizer(optimizer_name, loaded.partition.parameters, job.lr)
        heldout = dataset.heldout()
        every = job.checkpoint_every_steps or DEFAULT_CHECKPOINT_EVERY_STEPS
        torch.manual_seed(job.seed)
        meta = run.load_checkpoint(module, optimizer)
        if meta is None:
            accuracy_before = self._accuracy(module, loaded.spec.loss_value, heldout, job.grouping, batch_size)
            run.save_weights("initial.safetensors", module)
            meta = {"step": 0, "data_index": 0, "losses": [], "step_s": [], "energy_j": [], "peak_bytes": 0,
                    "accuracy_before": accuracy_before}
            run.save_checkpoint(module, optimizer, 0, 0, meta)
        else:
            self.log(f"resuming run {job.run_id} at step {meta['step']} of {job.steps}")
        events = EventStream(keep=False)
        raw: list = []  # (event, unix time) as the executor emits them, inside the step: kept cheap
        events.subscribe(lambda event: raw.append((event, time.time())))
        meter = default_energy_meter()
        rss = RssSampler()
        step, data_index = meta["step"], meta["data_index"]
        energy_source = meter.source
        # --compile: inductor's fused kernels (TRAIN only: VERIFY compares bitwise with eager, which they are not)
        inductor = job.compile and job.kind == fleet_pb2.JOB_KIND_TRAIN
        if inductor:
            self.log(f"run {job.run_id}: node functions through inductor (--compile); the first step compiles them")
        with ScheduleExecutor(loaded.partition, schedule, flash_dir=str(self.flash_dir), events=events,
                              energy_meter=meter, log=self.log, inductor=inductor,
                              return_freed_memory=self.return_freed_memory) as executor:
            for batch in dataset.batches(batch_size, job.seed, start_index=data_index, count=job.steps - step):
                if cancel.is_set():
                    raise JobCancelled(f"run {job.run_id} stopped at step {step}; its checkpoint stays for a resume")
                x, y = self._tensors(batch, job.grouping)
                outcome = executor.train_step((x,), y, optimizer)
                step, data_index = step + 1, batch.next_index
                # to messages after the step, so the conversion is not timed as part of the step's instructions
                pending = [telemetry_event_to_proto(event, job_id=job.job_id, unix_time_s=unix_time_s)
                           for event, unix_time_s in raw]
                raw.clear()
                for message in pending:  # the job's step number from 1, not the executor's index (0 again on a resume)
                    if message.WhichOneof("event") == "step":
                        message.step.step = step
                meta["losses"].append(outcome.loss)
                meta["step_s"].append(outcome.duration_s)
                meta["energy_j"].append(outcome.summary.energy_j)
                meta["peak_bytes"] = max(meta["peak_bytes"], outcome.peak_tracked_bytes)
                energy_source = outcome.summary.energy_source or energy_source
                pending.append(rss_event_to_proto(rss.rss_bytes(), job_id=job.job_id, unix_time_s=time.time()))
                telemetry.emit_many(pending)  # blocks while the buffer is full: back-pressure, never a drop
                if progress is not None:
                    progress(step)
                if step % every == 0 or step == job.steps:
                    run.save_checkpoint(module, optimizer, step, data_index, meta)
        self._finish_training(job, model_path, run, module, loaded.spec.loss_value, meta, dataset, heldout,
                              batch_size, optimizer_name, energy_source, result)

    def _finish_training(self, job, model_path: Path, run, module, loss_value: str, meta: dict, dataset, heldout,
                         batch_size: int, optimizer_name: str, energy_source: str, result) -> None:
        """After the last step, wherever it ran: accuracy, weights, the result's figures, collect and verify."""
        if not math.isfinite(meta["losses"][-1] if meta["losses"] else 0.0):
            raise JobError(f"training diverged: the loss at step {len(meta['losses'])} is {meta['losses'][-1]}; "
                           "lower --lr")
        accuracy_after = self._accuracy(module, loss_value, heldout, job.grouping, batch_size)
        weights, weights_digest = run.save_weights("weights.safetensors", module)
        result.loss_per_step.extend(meta["losses"])
        if meta["accuracy_before"] is not None:
            result.accuracy_before = meta["accuracy_before"]
        if accuracy_after is not None:
            result.accuracy_after = accuracy_after
        result.param_digest = param_digest(module)
        energies = [e for e in meta["energy_j"] if e is not None]
        result.measured.CopyFrom(fleet_pb2.StepFigures(step_s=statistics.median(meta["step_s"]),
                                                       peak_ram_bytes=meta["peak_bytes"],
                                                       energy_source=energy_source))
        if energies:
            result.measured.energy_j = statistics.median(energies)
        self._collect(job, run, module, weights, weights_digest, result)
        if job.kind == fleet_pb2.JOB_KIND_VERIFY:
            result.max_rel_param_diff = self._verify(job, model_path, module, dataset, batch_size, optimizer_name)

    def _collect(self, job, run, module, weights: bytes, weights_digest: str, result) -> None:
        if job.collect in (fleet_pb2.COLLECT_UNSPECIFIED, fleet_pb2.COLLECT_NONE):
            return
        if job.collect == fleet_pb2.COLLECT_DELTA:
            initial = load_file(str(run.dir / "initial.safetensors"))
            final = _state_tensors(module)
            weights = save({k: (final[k].double() - initial[k].double()).to(final[k].dtype)
                            if final[k].is_floating_point() else final[k] for k in final})
            weights_digest = hashlib.sha256(weights).hexdigest()
        if len(weights) > MAX_INLINE_WEIGHTS_BYTES:
            raise JobError(f"the collected weights are {len(weights)} bytes, over the {MAX_INLINE_WEIGHTS_BYTES} "
                           "bytes a result may carry; run with --collect none (the weights stay on the board)")
        result.weights.CopyFrom(fleet_pb2.WeightsRef(collect=job.collect, digest=weights_digest,
                                                     size_bytes=len(weights), safetensors=weights))

    def _verify(self, job, model_path: Path, trained, dataset, batch_size: int, optimizer_name: str) -> float:
        """The same steps trained plainly from the archive's weights; the largest relative parameter difference."""
        plain = load_module(model_path)
        optimizer = make_optimizer(optimizer_name, [p for p in plain.parameters() if p.requires_grad], job.lr)
        torch.manual_seed(job.seed)
        for batch in dataset.batches(batch_size, job.seed, count=job.steps):
            x, y = self._tensors(batch, job.grouping)
            plain_train_step(lambda *inputs, y=y: plain(*inputs, labels=y), _loss_of, (x,), y, optimizer)
        return parameter_differences(trained, plain)["max_rel_param_diff"]

    # ------------------------------------------------------------------------------ data
    def _dataset(self, job) -> tuple[LocalDataset, int]:
        grouping = job.grouping
        batch_size = int(grouping.batch_shape[0])
        if job.dataset == SYNTHETIC_DATASET:  # a calibration run: random samples of the model's shape
            return SyntheticDataset(tuple(grouping.batch_shape[1:]), grouping.num_classes, batch_size, job.seed,
                                    label_shape=tuple(grouping.class_index_shape[1:])), batch_size
        try:
            dataset = LocalDataset(self.data_dir, job.dataset)
        except DatasetError as error:
            raise JobError(str(error)) from None
        if job.batch_size and job.batch_size != batch_size:
            raise JobError(f"the job asks for batches of {job.batch_size} but its model was exported for "
                           f"{batch_size}; submit the run with --batch-size {job.batch_size} so the host traces it")
        sample_shape = tuple(grouping.batch_shape[1:])
        if tuple(dataset.x.shape[1:]) != sample_shape:
            raise JobError(f"dataset {job.dataset!r} has samples of shape {tuple(dataset.x.shape[1:])}, but the model "
                           f"takes {sample_shape}: pick a dataset made for this model")
        if grouping.num_classes and (dataset.y.min() < 0 or dataset.y.max() >= grouping.num_classes):
            raise JobError(f"dataset {job.dataset!r} has class indices outside 0..{grouping.num_classes - 1}, the "
                           "model's classes")
        return dataset, batch_size

    @staticmethod
    def _tensors(batch, grouping) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = getattr(torch, grouping.batch_dtype or "float32")
        return torch.from_numpy(np.ascontiguousarray(batch.x)).to(dtype), torch.from_numpy(
            np.ascontiguousarray(batch.y)).to(torch.int64)

    def _accuracy(self, module, loss_value: str, heldout, grouping, batch_size: int) -> float | None:
        """Share of held-out samples classified right, with the training program (padded to its batch size).

        The program is the training-mode export: BatchNorm uses batch statistics. Its buffers are restored
        afterwards, and the RNG is left as it was, so measuring never changes training.
        """
        if heldout is None:
            return None
        x_all, y_all = heldout
        logits_node = _logits_node(module, loss_value)
        correct = 0
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for start in range(0, len(y_all), batch_size):
                x = x_all[start:start + batch_size]
                y = y_all[start:start + batch_size]
                real = len(y)
                if real < batch_size:  # the export has a fixed batch size: pad with the first samples
                    pad = batch_size - real
                    x = np.concatenate([x, np.resize(x_all, (pad, *x_all.shape[1:]))])
                    y = np.concatenate([y, np.resize(y_all, pad)])
                xt, yt = self._tensors(Batch(x, y, 0), grouping)
                logits = _Capture(module, logits_node).run(xt, yt)
                correct += int((logits[:real].argmax(dim=-1) == yt[:real]).sum())
            for buffer, saved in buffers:
                buffer.copy_(saved)
        return correct / len(y_all)


def _loss_of(output, labels):
    """The exported program returns its loss already (the loss is part of the program)."""
    return output


def _logits_node(module, loss_value: str) -> str:
    """The value the loss reads besides the labels: the model's output."""
    by_name = {n.name: n for n in module.graph.nodes}
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    labels = placeholders[-1]
    seen, frontier = set(), [by_name[loss_value]]
    # Walk back from the loss to the first node that does not depend on the labels.
    while frontier:
        node = frontier.pop()
        for arg in node.all_input_nodes:
            if arg in seen or arg.op in ("placeholder", "get_attr"):
                continue
            seen.add(arg)
            if not _depends_on(arg, labels):
                return arg.name
            frontier.append(arg)
    raise JobError("cannot find the model's output in the program: accuracy needs a classifier")


def _depends_on(node, target) -> bool:
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current is target:
            return True
        for arg in current.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return False


class _Capture(torch.fx.Interpreter):
    """Runs the program and returns the value of one node (the logits)."""

    def __init__(self, module, node_name: str) -> None:
        super().__init__(module)
        self.node_name = node_name
        self.value = None

    def run_node(self, node):
        value = super().run_node(node)
        if node.name == self.node_name:
            self.value = value
        return value

    def run(self, x, y):  # noqa: D102
        super().run(x, y)
        return self.value
