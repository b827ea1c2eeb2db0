"""Executor benchmark: POET against plain PyTorch and what users would pick instead. Prints tables, never fails.

1. Overhead without memory pressure: step time of the keep-all schedule against plain PyTorch (targets: at most
   1.03x at layer granularity, 1.01x at block granularity). Each method runs in a process of its own, their steps
   taken in turn (so drift on a shared machine hits them alike, while each has a C heap of its own: in one
   process, one method's frees decide another's page faults).
2. At each budget (default 50% and 30% of the no-remat peak): energy, time, measured peak RSS and tracked
   bytes of POET's schedule against the alternatives a user has: plain training, ``checkpoint_sequential(k)``
   for each useful k, per-block checkpointing, selective activation checkpointing per block (a policy that
   saves matmul and convolution outputs and recomputes the rest, as torch documents), ``torch.compile`` with
   ``torch._functorch.config.activation_memory_budget`` set to the same share, and
   ``torch.autograd.graph.save_on_cpu`` (on a CPU-only machine that is plain training: nothing moves).
   Time and energy: all methods in one process, their steps interleaved (so drift on a shared machine
   hits them alike), with freed memory kept for reuse as ``poet train`` does. Peak: each method alone
   in its own process, with ``MALLOC_MMAP_THRESHOLD_=4096`` so every tensor of a page or more has pages of
   its own, which leave RSS when it is freed, and the RSS high-water mark is the live-memory peak for every
   method alike. ``peak_rss_bytes`` is that mark above the step-start RSS in steady state: what a step adds
   to the process as training goes on. ``peak_rss_after_trim_bytes`` is the mark in the steps right after
   the C heap is trimmed, which also counts the free heap pages those steps touch again: how many depends on
   the holes the process's earlier work left in its heap (tracing, compiling), 0.6-1.1 MB for POET on hf_bert
   at 30%. ``process_rss_bytes`` is the RSS at the start of a steady-state step (model, libraries, traced
   graphs). With a 64 KiB threshold, tensors below it (dropout masks, norm statistics) went to those heap
   holes too. POET's schedule is solved on the quick local profile fitted to the
   executor's telemetry of this model first (``host.calibrate``: a keep-all run and a paging run, 4 steps
   each); ``--no-calibrate`` solves on the quick profile as is.

    python bench/executor.py [--models resnet18_cifar,hf_bert,mlp] [--budgets 50%,30%] [--part 1|2] [--json]

``--compile`` adds POET with its node functions through inductor (``poet train --compile``; fused kernels,
not bitwise eager): in part 2 a ``POET --compile`` row per budget, its schedule solved on a coarser trace
(``--compile-granularity``, default ``auto``: per budget, the coarsest block depth that leaves the solver
room), and in part 1 two more methods taking turns with the others per granularity, POET --compile's keep-all and
``torch.compile`` of the whole model, each as a ratio to plain.

``--granularity`` sets the nodes of part 2's POET rows: layer (the default, what ``poet solve`` gives), ``block:N``,
or ``auto`` as above (uncompiled, coarser nodes make fewer calls per step: part 1's block rows).

Part 1 runs at three granularities (layer, block:2, block:1) under two allocator settings: glibc's
default, and glibc keeping freed memory for reuse (``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_``, what ``poet train`` sets by default), which separates the executor's own
cost from page faults caused by memory going back to the OS and returning.

How the budget applies. POET is held to ``share x`` the solver's no-remat peak by its executor, which
tracks activations, their gradients and paged-in buffers (``tracked_bytes`` = the executor's
peak_tracked_bytes). An alternative's ``tracked_bytes`` is measured in one extra step of its own process
by a TorchDispatchMode that counts the storages every aten op creates and holds them as live until they
are freed: the peak of activations, recomputed activations, gradients of activations and temporaries
during forward and backward, without weights, weight gradients, optimizer state and the batch. It fits
the budget when that peak is at most ``share x`` plain training's peak counted the same way (so the
meter's own bias cancels). ``torch.compile`` runs inductor kernels whose buffers are allocated outside
the dispatcher; its tracked bytes are what its compiled forward saves for backward (counted with
``saved_tensors_hooks``), compared with what plain training saves. ``tracked_source`` says which.

Energy: the best energy meter of this machine where one exists (``measured:rapl``, ...), else modelled
(process CPU time x the profile's power, ``modelled:cpu-time×power``); ``energy_source`` says which.
Torch threads: ``--threads`` (default 1, stable on a shared machine; the profile's power is for that many).
3. Paging overlap: a paging-only schedule at 30% run with page transfers on the executor's I/O thread behind
   compute, and with each transfer waited for at its instruction (``overlap_paging=False``), interleaved.

``--json`` prints one JSON object on stdout (keys ``overhead``, ``methods``, ``budgets``, ``overlap``); the
tables go to stderr then.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# ----------------------------------------------------------------------------- part 1: overhead
def _per_node_autograd_step(partition, inputs, labels, optimizer) -> None:
    """The floor of running a model node by node: the partition's programs, each output detached into a new
    leaf and each node differentiated by its own ``torch.autograd.grad`` call, as the executor does, but
    with no RAM store, saved-tensor hooks, telemetry or checks. Autograd keeps what it saves itself."""
    env = dict(zip(partition.batch_values, inputs, strict=True))
    env[partition.label_value] = labels
    programs = [p for i, p in sorted(partition.programs.items()) if p.run is not None]
    last_read = {v: i for i, program in enumerate(programs) for v in program.input_values}
    optimizer.zero_grad(set_to_none=True)
    graphs = []
    for i, program in enumerate(programs):
        leaves = {}
        fed = []
        for value in program.input_values:
            tensor = env[value]
            if program.bwd_index is not None and value in program.grad_input_values:
                tensor = leaves[value] = tensor.detach().requires_grad_(True)
            fed.append(tensor)
        with torch.enable_grad():
            outputs = dict(zip(program.output_values, program.run(*fed), strict=True))
        for value in program.input_values:
            if last_read.get(value) == i:
                env.pop(value, None)
        env.update((name, output.detach()) for name, output in outputs.items())
        if program.bwd_index is not None:
            graphs.append((program, leaves, outputs))
    grads = {partition.loss_value: torch.ones(())}
    while graphs:
        program, leaves, outputs = graphs.pop()
        roots = [(outputs[name], grads.pop(name)) for name in outputs if name in grads and outputs[name].requires_grad]
        if not roots:
            continue
        results = torch.autograd.grad([r for r, _ in roots], [*leaves.values(), *program.params],
                                      grad_outputs=[g for _, g in roots], allow_unused=True)
        for name, grad in zip(leaves, results, strict=False):
            if grad is not None:
                grads[name] = grads[name] + grad if name in grads else grad
        for param, grad in zip(program.params, results[len(leaves):], strict=True):
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad + grad
    optimizer.step()


def overhead_rows(model: str, batch_size: int, steps: int, threads: int, compiled: bool = False) -> list[dict]:
    """Keep-all schedule against plain PyTorch (and the per-node floor), per granularity, each method in a
    process of its own and their steps taken in turn (see :class:`_Workers`), in two rounds of half the steps
    whose processes start in opposite orders; ``compiled``: also POET --compile's keep-all and torch.compile of
    the whole model."""
    base = {"model": model, "batch_size": batch_size, "threads": threads}
    names = ("plain", "floor", "autograd", "schedule") + (("compiled", "torch.compile") if compiled else ())
    granularities = (("layer", 1), ("block", 2), ("block", 1))
    times_s = {g: {name: [] for name in names} for g in granularities}
    faults = {g: {name: [] for name in names} for g in granularities}
    infos = {}
    for round_names, round_steps in ((names, steps - steps // 2), (names[::-1], steps // 2)):
        if round_steps == 0:
            continue
        with _Workers(round_names) as workers:
            workers.setup("plain", {**base, "method": "plain"})
            if compiled:
                workers.setup("torch.compile", {**base, "method": "torch.compile"})
            for granularity, depth in granularities:
                for name in round_names:
                    if name not in ("plain", "torch.compile"):
                        info = workers.setup(name, {**base, "method": name, "granularity": granularity,
                                                    "depth": depth})
                        if name == "schedule":
                            infos[granularity, depth] = info
                for _ in range(round_steps):
                    for name in round_names:
                        seconds, page_faults = workers.step(name)
                        times_s[granularity, depth][name].append(seconds)
                        faults[granularity, depth][name].append(page_faults)
    return [_overhead_row(names, times_s[g], faults[g], infos[g]) for g in granularities]


class _Workers:
    """One process per method of part 1, driven in lock step: each step of each method runs alone (the others
    wait on their pipes), the methods taking turns, so drift on a shared machine hits them alike while each
    has a C heap of its own. In one process, glibc's heap (its trim and mmap thresholds, its free blocks) is
    shared, and one workload's frees decide the other's page faults: resnet18_cifar at block:2 with glibc's
    default, POET alone 0 faults per step, plain alone 30,000; interleaved in one process, 3,300 and 1,800.

    Processes running the same steps are not equally fast: five of plain resnet18_cifar (batch 128), steps in a
    shuffled turn, had medians up to 4% apart, the last started fastest; POET's started before plain's measured
    1.031x, after it 1.007x. So part 1 runs two rounds whose processes start in opposite orders."""

    def __init__(self, names) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._pipes = {}
        self._processes = []
        for name in names:
            parent, child = context.Pipe()
            process = context.Process(target=_overhead_worker, args=(child,), daemon=True, name=f"part1-{name}")
            process.start()
            child.close()
            self._pipes[name] = parent
            self._processes.append(process)

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc) -> None:
        for pipe in self._pipes.values():
            try:
                pipe.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        for process in self._processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()

    def _ask(self, name: str, command: str, payload=None):
        pipe = self._pipes[name]
        pipe.send((command, payload))
        ok, answer = pipe.recv()
        if not ok:
            raise RuntimeError(f"part 1's {name} worker: {answer}")
        return answer

    def setup(self, name: str, spec: dict) -> dict:
        return self._ask(name, "setup", spec)

    def step(self, name: str) -> tuple[float, int]:
        return self._ask(name, "step")


def _overhead_worker(pipe) -> None:
    """A part-1 method in its own process: ``setup`` builds it (and runs its warm-up steps, which capture and
    lower POET's step or compile torch.compile's), ``step`` times one step (seconds, minor page faults)."""
    import resource
    import traceback

    run, close = None, None
    while True:
        command, payload = pipe.recv()
        if command in ("stop", "setup") and close is not None:  # the last method's executor goes first
            close()
            run, close = None, None
        if command == "stop":
            return
        try:
            if command == "setup":
                torch.set_num_threads(payload["threads"])
                run, info, close = _overhead_method(payload)
                for _ in range(2):
                    run()
                answer = info() if callable(info) else info
            else:
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                started = time.perf_counter()
                run()
                answer = (time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
            pipe.send((True, answer))
        except Exception:  # noqa: BLE001 - the parent names the worker and shows the traceback
            pipe.send((False, traceback.format_exc(limit=8)))


def _overhead_method(spec: dict):
    """(step function, info, close or None) of one part-1 method: its model bundle built here, with seed 0 as every
    other's."""
    from device_agent.executor import ScheduleExecutor, plain_train_step
    from host.costs import load_profile, price_graph
    from host.graph.partition import partition_from_traced
    from host.graph.trace import trace_model
    from host.graph.zoo import get_model_spec
    from host.solver.solve import SolveOptions, no_remat_peak_bytes, solve_schedule

    method = spec["method"]
    bundle = get_model_spec(spec["model"]).bundle(spec["batch_size"], seed=0)
    sgd = torch.optim.SGD(bundle.module.parameters(), lr=0.01, momentum=0.9)
    if method == "plain":
        return (lambda: plain_train_step(bundle.module, bundle.loss_fn, bundle.inputs, bundle.labels, sgd)), {}, None
    if method == "torch.compile":
        forward = torch.compile(bundle.module)

        def whole_step() -> None:
            sgd.zero_grad(set_to_none=True)
            bundle.training_loss(forward(*bundle.inputs), bundle.labels).backward()
            sgd.step()
        return whole_step, {}, None
    traced = trace_model(bundle, granularity=spec["granularity"], block_depth=spec["depth"])
    partition = partition_from_traced(traced)
    if method == "floor":
        return (lambda: _per_node_autograd_step(partition, bundle.inputs, bundle.labels, sgd)), {}, None
    priced = price_graph(traced.graph, load_profile("a72"))
    schedule = solve_schedule(priced, SolveOptions(ram_budget_bytes=no_remat_peak_bytes(priced))).schedule
    executor = ScheduleExecutor(partition, schedule, node_functions=method != "autograd",
                                inductor=method == "compiled")
    last = {}

    def step() -> None:
        last["result"] = executor.train_step(bundle.inputs, bundle.labels, sgd)

    def info() -> dict:
        return {"granularity": _granularity_text((spec["granularity"], spec["depth"])), "nodes": traced.graph.size,
                "instructions": len(schedule.instructions), "lowered": last["result"].lowered,
                "autograd_nodes": len(executor.autograd_nodes)}
    return step, info, executor.close


def _overhead_row(names, times_s: dict[str, list[float]], faults: dict[str, list[int]], info: dict) -> dict:
    """One granularity's row from its steps (both rounds): ratios per step against plain's, taken beside it."""

    def paired(name: str) -> list[float]:
        return sorted(a / b for a, b in zip(times_s[name], times_s["plain"], strict=True))

    ratios = paired("schedule")
    ratio = statistics.median(ratios)
    autograd_ratio = statistics.median(paired("autograd"))
    instructions = info["instructions"]
    plain_s = statistics.median(times_s["plain"])
    compiled_columns = {}
    if "compiled" in names:
        compiled_columns = {"compiled_ratio": statistics.median(paired("compiled")), "uncompiled_ratio": ratio,
                            "torch_compile_ratio": statistics.median(paired("torch.compile"))}
    return {
        **compiled_columns,
        **info,
        "plain_s": plain_s,
        "schedule_s": statistics.median(times_s["schedule"]),
        "ratio": ratio,  # median over steps of schedule/plain, each pair from one turn
        "ratio_q1": ratios[len(ratios) // 4],
        "ratio_q3": ratios[(3 * len(ratios)) // 4],
        "floor_ratio": statistics.median(paired("floor")),
        "autograd_s": statistics.median(times_s["autograd"]),
        "autograd_ratio": autograd_ratio,
        # what each instruction costs beyond plain PyTorch's step, from the median ratios
        "overhead_us_per_instruction": (ratio - 1) * plain_s / instructions * 1e6,
        "autograd_overhead_us_per_instruction": (autograd_ratio - 1) * plain_s / instructions * 1e6,
        # minor page faults per step (memory the C heap gave back to the OS and touched again), medians
        "plain_page_faults_per_step": statistics.median(faults["plain"]),
        "poet_page_faults_per_step": statistics.median(faults["schedule"]),
    }


# ----------------------------------------------------------------------------- part 3: paging overlap
def overlap_rows(model: str, batch_size: int, share: float, steps: int, threads: int, flash_dir: str,
                 time_limit_s: float) -> list[dict]:
    """A paging-only schedule at ``share`` of the no-remat peak, run with page transfers on the I/O thread
    behind compute and with each transfer waited for at its instruction, steps interleaved in one process."""
    from device_agent.executor import ScheduleExecutor
    from host.costs import load_profile, price_graph
    from host.graph.partition import partition_from_traced
    from host.graph.trace import trace_model
    from host.graph.zoo import get_model_spec
    from host.solver.solve import SolveOptions, no_remat_peak_bytes, solve_schedule

    torch.set_num_threads(threads)
    spec = get_model_spec(model)
    bundles = {"overlapped": spec.bundle(batch_size, seed=0), "in place": spec.bundle(batch_size, seed=0)}
    traced = {name: trace_model(bundle, granularity="layer") for name, bundle in bundles.items()}
    priced = price_graph(traced["overlapped"].graph, load_profile("m0"))  # flash cheap against compute: pages
    budget = share * no_remat_peak_bytes(priced)
    result = solve_schedule(priced, SolveOptions(ram_budget_bytes=budget, remat=False, runtime_factor=4.0,
                                                 time_limit_s=time_limit_s))
    if result.schedule is None:
        return [{"model": model, "error": f"no paging schedule at {share:.0%}: {result.status}"}]
    schedule = result.schedule
    times_s: dict[str, list[float]] = {name: [] for name in bundles}
    paging_s: dict[str, list[float]] = {name: [] for name in bundles}
    with tempfile.TemporaryDirectory(dir=flash_dir) as pages:
        executors = {name: ScheduleExecutor(partition_from_traced(traced[name]), schedule, flash_dir=pages,
                                            overlap_paging=name == "overlapped") for name in bundles}
        optimizers = {name: torch.optim.SGD(bundle.module.parameters(), lr=0.01) for name, bundle in bundles.items()}
        try:
            for step in range(steps + 2):
                for name, bundle in bundles.items():
                    started = time.perf_counter()
                    outcome = executors[name].train_step(bundle.inputs, bundle.labels, optimizers[name])
                    if step >= 2:
                        times_s[name].append(time.perf_counter() - started)
                        paging_s[name].append(outcome.summary.paging_s)
        finally:
            for executor in executors.values():
                executor.close()
    counts = schedule.counts()
    base = statistics.median(times_s["in place"])
    return [{"model": model, "batch_size": batch_size, "budget_share": share, "mode": name,
             "page_outs": counts["page_outs"], "page_ins": counts["page_ins"],
             "s_per_step": statistics.median(times_s[name]), "paging_s_per_step": statistics.median(paging_s[name]),
             "saved_s_per_step": base - statistics.median(times_s[name])} for name in bundles]


def _print_overlap(model: str, args, batch_size: int, log) -> list[dict]:
    print(f"\n## 3. {model}: a paging-only schedule at 30% of the no-remat peak (m0 profile, layer granularity, "
          f"batch {batch_size}), page transfers overlapped with compute or waited for in place, interleaved, "
          f"medians of {args.overhead_steps} steps; paging s: the transfers' own time\n", file=log)
    config = {"model": model, "batch_size": batch_size, "share": 0.3, "steps": args.overhead_steps,
              "threads": args.threads, "flash_dir": os.path.abspath(args.flash_dir), "time_limit_s": args.time_limit}
    rows = _spawn(config, mode="--run-overlap")
    print(f"{'mode':<12} {'page-outs':>9} {'page-ins':>8} {'s/step':>9} {'paging s':>9} {'saved s':>9}", file=log)
    for row in rows:
        if "error" in row:
            print(row["error"], file=log)
            continue
        print(f"{row['mode']:<12} {row['page_outs']:>9} {row['page_ins']:>8} {row['s_per_step']:>9.4f} "
              f"{row['paging_s_per_step']:>9.4f} {row['saved_s_per_step']:>9.4f}", file=log, flush=True)
    return rows


# ----------------------------------------------------------------------------- part 2: the alternatives
DEFAULT_MODELS = ("resnet18_cifar", "hf_bert", "mlp")
# Batch per model: (part 1, part 2). Part 2's mlp batch is larger so its activations stand out of RSS noise.
BATCH_SIZES = {"resnet18_cifar": (128, 64), "hf_bert": (16, 16), "mlp": (128, 512)}
CHECKPOINT_SEGMENTS = (2, 3, 4, 6)  # checkpoint_sequential's k, those below the model's number of pieces
# What selective activation checkpointing saves: matmul, attention and convolution outputs; everything else
# (pointwise ops, norms, softmax) is recomputed in backward.
_aten = torch.ops.aten
SAC_SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.convolution.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default, _aten._scaled_dot_product_efficient_attention.default,
})


def _sac_policy(ctx, op, *args, **kwargs):
    """Selective checkpointing's policy: save matmul/conv outputs, recompute pointwise ops (torch's documented recipe)."""
    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _Embeddings(torch.nn.Module):
    """A Hugging Face BERT's embeddings as a one-argument module (``input_ids`` -> hidden states)."""

    def __init__(self, embeddings: torch.nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(input_ids=input_ids)


def _pieces(module: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """The zoo model as (flat pieces for checkpoint_sequential, blocks for per-block checkpointing), each list a
    chain that computes what ``module`` computes. Supported: the zoo ResNets, the HF BERT wrapper, nn.Sequential."""
    if hasattr(module, "stem") and hasattr(module, "blocks"):  # zoo ResNet
        flat = [module.stem, *module.blocks, module.pool, module.flatten, module.fc]
        return flat, [module.stem, *module.blocks, torch.nn.Sequential(module.pool, module.flatten, module.fc)]
    inner = getattr(module, "model", None)
    if inner is not None and hasattr(inner, "bert") and hasattr(inner, "cls"):  # zoo hf_bert (HFLogits)
        # BertModel without an attention mask gives its layers none (eager attention adds nothing).
        flat = [_Embeddings(inner.bert.embeddings), *inner.bert.encoder.layer, inner.cls]
        return flat, flat
    if isinstance(module, torch.nn.Sequential):  # a block: a layer with parameters and the parameter-free ones after
        blocks: list[list[torch.nn.Module]] = []
        for layer in module:
            if not blocks or any(True for _ in layer.parameters()):
                blocks.append([])
            blocks[-1].append(layer)
        return list(module), [b[0] if len(b) == 1 else torch.nn.Sequential(*b) for b in blocks]
    raise SystemExit(f"part 2 does not know how to split {type(module).__name__} into checkpointable pieces")


class _Checkpointed(torch.nn.Module):
    """Runs ``inner`` under torch.utils.checkpoint (non-reentrant), with an optional ``context_fn`` (selective)."""

    def __init__(self, inner: torch.nn.Module, context_fn=None) -> None:
        super().__init__()
        self.inner = inner
        self.context_fn = context_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.context_fn is None:
            return checkpoint(self.inner, x, use_reentrant=False)
        return checkpoint(self.inner, x, use_reentrant=False, context_fn=self.context_fn)


class _BudgetBackend:
    """torch.compile's inductor with ``activation_memory_budget`` = ``share`` while it partitions the joint graph.

    A backend object per share: dynamo keys its cache on the backend, so two shares in one process compile twice.
    """

    def __init__(self, share: float) -> None:
        self.share = share
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        with torch._functorch.config.patch(activation_memory_budget=self.share):
            return compile_fx(graph_module, example_inputs)


def _storage(tensor: torch.Tensor):
    return tensor.untyped_storage()


class _LiveActivationBytes(TorchDispatchMode):
    """Peak bytes of the storages that aten ops create during a step, each held as live until it is freed.

    Storages present before the step (weights, buffers, optimizer state, the batch) are not counted; weight
    gradients are taken out afterwards (``peak_bytes(exclude=...)``). Frees are seen at the next op.
    """

    def __init__(self, present: list[torch.Tensor]) -> None:
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weak = StorageWeakRef
        self.present = {_storage(t).data_ptr() for t in present}
        self.live: dict[int, tuple[object, int, int]] = {}  # data_ptr -> (weak ref, nbytes, serial)
        self.events: list[tuple[int, int]] = []  # (serial, +nbytes at creation / -nbytes when freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ptr, (ref, nbytes, serial) in list(self.live.items()):
            if ref.expired():
                del self.live[ptr]
                self.events.append((serial, -nbytes))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = _storage(tensor)
                ptr = storage.data_ptr()
                if ptr and ptr not in self.present and ptr not in self.live:
                    self.live[ptr] = (self._weak(storage), storage.nbytes(), len(self.events))
                    self.events.append((len(self.events), storage.nbytes()))
        return out

    def peak_bytes(self, exclude: list[torch.Tensor]) -> int:
        """The peak over the step, without the storages of ``exclude`` (weight gradients) still live at its end."""
        excluded = {self.live[p][2] for t in exclude if (p := _storage(t).data_ptr()) in self.live}
        current = peak = 0
        for serial, delta in self.events:
            if serial not in excluded:
                current += delta
                peak = max(peak, current)
        return peak


class _SavedBytes:
    """Peak bytes of the distinct storages autograd saves for backward (``saved_tensors_hooks``), weights excluded."""

    def __init__(self, present: list[torch.Tensor]) -> None:
        self.present = {_storage(t).data_ptr() for t in present}
        self.counts: dict[int, list[int]] = {}  # data_ptr -> [holders, nbytes]
        self.current = self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)

    def _pack(self, tensor: torch.Tensor):
        ptr = _storage(tensor).data_ptr()
        held = _Held(tensor, self, ptr)
        if ptr and ptr not in self.present:
            entry = self.counts.setdefault(ptr, [0, _storage(tensor).nbytes()])
            entry[0] += 1
            if entry[0] == 1:
                self.current += entry[1]
                self.peak = max(self.peak, self.current)
        return held

    def release(self, ptr: int) -> None:
        entry = self.counts.get(ptr)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.current -= entry[1]
                del self.counts[ptr]


class _Held:
    """What autograd keeps instead of a saved tensor: the tensor, and a release of its count when autograd lets go."""

    __slots__ = ("tensor", "owner", "ptr")

    def __init__(self, tensor: torch.Tensor, owner: _SavedBytes, ptr: int) -> None:
        self.tensor, self.owner, self.ptr = tensor, owner, ptr

    def __del__(self) -> None:
        self.owner.release(self.ptr)


def _error_text(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


class _Method:
    """One training method on its own copy of the model: ``step()`` trains one step, returns paging seconds."""

    def __init__(self, config: dict, method: dict, meter) -> None:
        from device_agent.executor import ScheduleExecutor, plain_train_step
        from device_agent.serde import read_schedule_file
        from host.graph.granularity import parse_granularity
        from host.graph.partition import partition_from_traced
        from host.graph.trace import trace_model
        from host.graph.zoo import get_model_spec

        self.bundle = bundle = get_model_spec(config["model"]).bundle(config["batch_size"], seed=0)
        self.optimizer = torch.optim.SGD(bundle.module.parameters(), lr=0.01, momentum=0.9)
        self.kind = method["method"]
        self.segments = method.get("segments")
        self.executor = None
        self.backend = None
        self.peak_tracked_bytes = 0  # POET: the executor's, maximum over steps
        self._plain_step = plain_train_step
        flat, blocks = _pieces(bundle.module)
        if self.kind == "poet":
            traced = trace_model(bundle, granularity=method.get("granularity", "layer"),
                                 block_depth=method.get("block_depth", 1))
            self.granularity = _granularity_text(parse_granularity(traced.granularity))
            self.executor = ScheduleExecutor(partition_from_traced(traced), read_schedule_file(method["schedule"]),
                                             flash_dir=config["flash_dir"], energy_meter=meter,
                                             inductor=method.get("inductor", False))
        elif self.kind == "sequential":
            self.forward = lambda x: checkpoint_sequential(torch.nn.Sequential(*flat), self.segments, x,
                                                           use_reentrant=False)
        elif self.kind == "per_block":
            self.forward = torch.nn.Sequential(*[_Checkpointed(b) for b in blocks])
        elif self.kind == "selective":
            context_fn = partial(create_selective_checkpoint_contexts, _sac_policy)
            self.forward = torch.nn.Sequential(*[_Checkpointed(b, context_fn) for b in blocks])
        elif self.kind == "compile":
            self.backend = _BudgetBackend(method["share"])
            self.forward = torch.compile(bundle.module, backend=self.backend)
        elif self.kind in ("plain", "save_on_cpu"):
            self.forward = bundle.module
        else:
            raise ValueError(f"unknown method {self.kind!r}")

    def step(self) -> float:
        bundle, optimizer = self.bundle, self.optimizer
        if self.executor is not None:
            result = self.executor.train_step(bundle.inputs, bundle.labels, optimizer)
            self.peak_tracked_bytes = max(self.peak_tracked_bytes, result.peak_tracked_bytes)
            return result.summary.paging_s
        if self.kind == "plain":  # the reference: the zoo module itself, eagerly
            self._plain_step(bundle.module, bundle.loss_fn, bundle.inputs, bundle.labels, optimizer)
            return 0.0
        optimizer.zero_grad(set_to_none=True)
        self.forward_backward()
        optimizer.step()
        return 0.0

    def forward_backward(self) -> None:
        bundle = self.bundle
        if self.kind == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=False):
                bundle.training_loss(self.forward(*bundle.inputs), bundle.labels).backward()
            return
        bundle.training_loss(self.forward(*bundle.inputs), bundle.labels).backward()

    def tracked(self) -> dict:
        """One more step, counted: the peak of live activation bytes (saved bytes for torch.compile, and plain)."""
        if self.executor is not None:
            return {"tracked_bytes": self.peak_tracked_bytes, "tracked_source": "executor peak_tracked_bytes",
                    "granularity": self.granularity}
        module, optimizer = self.bundle.module, self.optimizer
        present = [*module.parameters(), *module.buffers(), *self.bundle.inputs, self.bundle.labels,
                   *(t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))]
        optimizer.zero_grad(set_to_none=True)
        saved = _SavedBytes(present)
        result = {}
        if self.kind == "compile":  # inductor's buffers bypass the dispatcher: count what its forward saves
            with saved.hooks():
                self.forward_backward()
            return {"tracked_bytes": saved.peak, "tracked_source": "saved tensors (saved_tensors_hooks)",
                    "compiled_graphs": self.backend.graphs}
        live = _LiveActivationBytes(present)
        if self.kind == "plain":  # plain's saved bytes too: the reference of torch.compile's
            with live, saved.hooks():
                self.forward_backward()
            result["saved_tensor_bytes"] = saved.peak
        else:
            with live:
                self.forward_backward()
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        result.update(tracked_bytes=live.peak_bytes(exclude=grads), tracked_source="live activation bytes (dispatch)")
        optimizer.zero_grad(set_to_none=True)
        return result

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()


def _meter(config: dict):
    """The best energy meter here (RAPL, INA, PMIC), falling back to the modelled one on the profile's powers."""
    from device_agent.meters.modelled import ModelledEnergyMeter

    modelled = ModelledEnergyMeter(config["compute_power_w"], config["memory_power_w"], config["threads"])
    try:
        from device_agent.meters.registry import best_meter

        measured = best_meter(fallback=modelled)
    except Exception:  # noqa: BLE001 - a meter that cannot be read is no meter: model the energy
        measured = None
    return measured if measured is not None else modelled


def _warm_up_steps(spec: dict) -> int:
    """Steps before timing: torch.compile compiles the forward, then the backward; POET captures (and with
    inductor compiles) its node functions in its first step and lowers the step after it."""
    return 2 if spec["method"] == "compile" or spec.get("inductor") else 1


def run_timed(config: dict) -> list[dict]:
    """Every method in this one process, their steps interleaved: median step time and energy per method."""
    torch.set_num_threads(config["threads"])
    meter = _meter(config)
    methods, errors = [], {}
    for i, spec in enumerate(config["methods"]):
        try:
            method = _Method(config, spec, meter)
            for _ in range(_warm_up_steps(spec)):
                method.step()
            methods.append((i, method))
        except Exception as error:  # noqa: BLE001 - one method failing (no compiler) is a row, not the end
            errors[i] = _error_text(error)
    times_s = {i: [] for i, _ in methods}
    energies_j = {i: [] for i, _ in methods}
    source = getattr(meter, "source", "modelled:cpu-time×power")
    for _ in range(config["steps"]):
        for i, method in methods:
            start = meter.read()
            paging_s = method.step()
            end = meter.read()
            times_s[i].append(end.wall_s - start.wall_s)
            energies_j[i].append(meter.energy_j(start, end, paging_s)[0])
            source = getattr(meter, "source", source)
    results = [{"error": errors.get(i, "did not run")} for i in range(len(config["methods"]))]
    for i, method in methods:
        results[i] = {"step_s": statistics.median(times_s[i]), "energy_j": statistics.median(energies_j[i]),
                      "energy_source": source}
        if method.backend is not None:  # one compile per share, each with its own budget
            results[i]["compiled_graphs"] = method.backend.graphs
        method.close()
    return results


def run_peak(config: dict) -> dict:
    """One method alone in this process: the RSS high-water mark of its steps above the step-start RSS, then
    one counted step for its tracked bytes.

    Two marks: right after the C heap is trimmed (``peak_rss_after_trim_bytes``: free heap pages the steps
    touch again count), then in the steps after those (``peak_rss_bytes``, steady state: what a step adds to
    the process as training goes on); the row's names, as the row takes them."""
    from device_agent.executor.allocator import release_free_memory
    from device_agent.meters.memory import PeakRssSampler

    torch.set_num_threads(config["threads"])
    spec = config["methods"][0]
    try:
        method = _Method(config, spec, _meter(config))
        for _ in range(_warm_up_steps(spec)):
            method.step()
        release_free_memory()
        with PeakRssSampler() as after_trim:
            for _ in range(config["steps"]):
                method.step()
        with PeakRssSampler() as steady:
            for _ in range(config["steps"]):
                method.step()
        result = {"peak_rss_bytes": steady.peak_bytes - steady.start_bytes,
                  "peak_rss_after_trim_bytes": after_trim.peak_bytes - after_trim.start_bytes,
                  "process_rss_bytes": steady.start_bytes, **method.tracked()}
        method.close()
    except Exception as error:  # noqa: BLE001
        return {"error": _error_text(error)}
    return result


ALLOCATORS = {
    "glibc default": {},
    "glibc keeps freed memory": {"MALLOC_MMAP_THRESHOLD_": str(2 << 30), "MALLOC_TRIM_THRESHOLD_": str(2 << 30)},
    "returns freed memory at once": {"MALLOC_MMAP_THRESHOLD_": "4096"},  # every tensor of a page or more mmapped
}


def _spawn(config: dict, mode: str, allocator: str = "glibc default"):
    env = dict(os.environ)
    env.update(ALLOCATORS[allocator])
    out = subprocess.run([sys.executable, __file__, mode, json.dumps(config)], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} {config.get('methods', '')} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _calibrated(profile, resolved, args):
    """``profile`` fitted to the executor's telemetry of a keep-all run (and a paging one) of this model."""
    from device_agent.executor import EventStream, ScheduleExecutor
    from host.calibrate import calibrate_profile
    from host.costs import price_graph
    from host.graph.partition import partition_from_traced
    from host.solver.solve import SolveOptions, no_remat_peak_bytes, solve_schedule

    priced = price_graph(resolved.graph, profile)
    peak = no_remat_peak_bytes(priced)
    events = EventStream()
    bundle = resolved.bundle
    for options in (SolveOptions(ram_budget_bytes=peak),
                    SolveOptions(ram_budget_bytes=0.6 * peak, remat=False, time_limit_s=30)):
        schedule = solve_schedule(priced, options).schedule
        if schedule is None:  # no paging schedule at 60% (mlp: one node's working set is 75% of the peak)
            continue
        with ScheduleExecutor(partition_from_traced(resolved.traced), schedule, flash_dir=args.flash_dir,
                              events=events) as executor:
            for _ in range(4):
                executor.train_step(bundle.inputs, bundle.labels)
    threads = torch.get_num_threads()  # the profile's compute_power_w is for this many busy threads
    return calibrate_profile(profile, resolved.graph, events.instructions(),
                             cpu_power_w_per_thread=profile.compute_power_w / threads)


def _share_text(share: float) -> str:
    return f"{100 * share:g}%"


def _method_specs(model: str, batch_size: int, shares: list[float], schedules: dict[float, str],
                  granularity: dict[float, tuple[str, int]], compiled: dict[float, str],
                  compiled_granularity: dict[float, tuple[str, int]]) -> list[tuple]:
    """(label, config, share or None) of every method; POET (and POET --compile) and torch.compile once per share."""
    from host.graph.zoo import get_model_spec

    flat, _ = _pieces(get_model_spec(model).build())
    specs = [("plain", {"method": "plain"}, None)]
    specs += [("POET", {"method": "poet", "schedule": schedules[s], "granularity": granularity[s][0],
                        "block_depth": granularity[s][1]}, s) for s in shares if s in schedules]
    specs += [(COMPILED_POET, {"method": "poet", "schedule": compiled[s], "granularity": compiled_granularity[s][0],
                               "block_depth": compiled_granularity[s][1], "inductor": True}, s)
              for s in shares if s in compiled]
    specs += [(f"checkpoint_sequential({k})", {"method": "sequential", "segments": k}, None)
              for k in CHECKPOINT_SEGMENTS if k < len(flat)]
    specs += [("per-block checkpoint", {"method": "per_block"}, None),
              ("selective checkpoint (per block)", {"method": "selective"}, None)]
    specs += [("torch.compile", {"method": "compile", "share": s}, s) for s in shares]
    specs += [("save_on_cpu", {"method": "save_on_cpu"}, None)]
    return specs


def budget_rows(args, model: str, batch_size: int, shares: list[float], measured_profile, log) -> tuple[list, list]:
    """Solve POET at every share, time all methods interleaved, measure each alone: (budget infos, method rows)."""
    from device_agent.serde import write_schedule_file
    from host.costs import price_graph
    from host.graph.resolve import resolve_model
    from host.solver.solve import SolveOptions, no_remat_peak_bytes, solve_schedule

    torch.set_num_threads(args.threads)
    resolved = resolve_model(model, batch_size=batch_size)
    if args.calibrate:
        print(f"[{model}] calibrating the profile on the executor's telemetry", file=log, flush=True)
    profile = _calibrated(measured_profile, resolved, args) if args.calibrate else measured_profile
    priced = price_graph(resolved.graph, profile)
    peak = no_remat_peak_bytes(priced)
    workdir = tempfile.mkdtemp(prefix="poet-bench-")
    infos, schedules, compiled, compiled_granularity = {}, {}, {}, {}

    def solve(graph, share: float, label: str, paths: dict, name: str) -> dict:
        print(f"[{model}] solving {label} at {_share_text(share)} of the no-remat peak", file=log, flush=True)
        result = solve_schedule(graph, SolveOptions(ram_budget_bytes=share * peak, runtime_factor=args.runtime_budget,
                                                    time_limit_s=args.time_limit, paging=args.paging))
        solved = {"status": result.status, "gap": result.gap, "message": result.message, "nodes": graph.graph.size}
        if result.schedule is not None:
            paths[share] = os.path.join(workdir, f"{name}-{share}.json")
            write_schedule_file(result.schedule, paths[share])
            predicted = result.schedule.prediction
            solved.update(counts=result.schedule.counts(), predicted_runtime_s=predicted.runtime_s,
                          predicted_paging_s=predicted.paging_s, predicted_energy_j=predicted.energy_j,
                          predicted_peak_bytes=predicted.peak_ram_bytes)
        return solved

    poet_granularity = {}
    for share in shares:
        poet_priced = priced
        poet_granularity[share] = args.granularity
        if args.granularity != ("layer", 1):  # POET's own trace at the coarser nodes asked for
            poet_granularity[share], poet_priced = _graph_at_granularity(model, batch_size, profile, args.granularity,
                                                                         share * peak)
        info = {"model": model, "batch_size": batch_size, "budget_share": share, "no_remat_peak_bytes": peak,
                "budget_bytes": share * peak, "calibrated": args.calibrate,
                "granularity": _granularity_text(poet_granularity[share]),
                **solve(poet_priced, share, "POET", schedules, "schedule")}
        if args.compile:  # POET --compile runs coarser nodes (inductor fuses within a node): its own trace and solve
            granularity, compiled_priced = _graph_at_granularity(model, batch_size, profile, args.compile_granularity,
                                                          share * peak)
            compiled_granularity[share] = granularity
            info["compiled"] = {"granularity": _granularity_text(granularity),
                                **solve(compiled_priced, share, COMPILED_POET, compiled, "compiled")}
        infos[share] = info
    common = {
        "model": model, "batch_size": batch_size, "threads": args.threads, "steps": args.steps,
        # the meter's assumptions (calibration folds paging's CPU time into the solver's memory_power_w only)
        "compute_power_w": measured_profile.compute_power_w,  # profiled with args.threads threads
        "memory_power_w": measured_profile.memory_power_w, "flash_dir": args.flash_dir,
    }
    specs = _method_specs(model, batch_size, shares, schedules, poet_granularity, compiled, compiled_granularity)
    print(f"[{model}] timing {len(specs)} methods interleaved", file=log, flush=True)
    timed = _spawn({**common, "methods": [config for _, config, _ in specs]}, "--run-timed",
                   allocator="glibc keeps freed memory")
    measured = []
    for label, config, share in specs:
        print(f"[{model}] peak of {label}{'' if share is None else ' at ' + _share_text(share)}", file=log, flush=True)
        measured.append(_spawn({**common, "methods": [config]}, "--run-peak", allocator="returns freed memory at once"))
    for path in (*schedules.values(), *compiled.values()):
        os.unlink(path)
    os.rmdir(workdir)
    plain = measured[0]
    rows = []
    for share in shares:
        info = infos[share]
        info["plain_tracked_bytes"] = plain.get("tracked_bytes")
        info["measured_budget_bytes"] = share * plain["tracked_bytes"] if "tracked_bytes" in plain else None
        share_rows = [_method_row(model, batch_size, share, info, label, config, timing, memory, plain)
                      for (label, config, method_share), timing, memory in zip(specs, timed, measured, strict=True)
                      if method_share in (None, share)]
        if share not in schedules:  # POET's row says why, right after plain's
            share_rows.insert(1, {"model": model, "batch_size": batch_size, "budget_share": share, "method": "POET",
                                  **dict.fromkeys(METHOD_FIELDS), "fits_budget": False,
                                  "note": f"no schedule: {info['message']}"})
        if args.compile and share not in compiled:
            share_rows.insert(2, {"model": model, "batch_size": batch_size, "budget_share": share,
                                  "method": COMPILED_POET, **dict.fromkeys(METHOD_FIELDS), "fits_budget": False,
                                  "note": f"no schedule at {info['compiled']['granularity']} granularity: "
                                          f"{info['compiled']['message']}"})
        rows += share_rows
    return list(infos.values()), rows


# POET with its node functions through inductor, solved at --compile-granularity
COMPILED_POET = "POET --compile"

# --compile-granularity auto: the coarsest block depth whose hard floor (the largest node's inputs, output and workspace)
# is at most this share of the budget, leaving the solver room to schedule
AUTO_FLOOR_SHARE = 0.8
AUTO_MAX_DEPTH = 8


def _graph_at_granularity(model: str, batch_size: int, profile, granularity, budget_bytes: float):
    """(granularity, priced graph) of a POET trace: as asked, or with ``auto`` the coarsest block depth
    that leaves room under the budget (else layer)."""
    from host.costs import price_graph
    from host.graph.trace import trace_model
    from host.graph.zoo import get_model_spec
    from host.solver.solve import minimum_ram_bytes

    bundle = get_model_spec(model).bundle(batch_size, seed=0)
    candidates = [("block", depth) for depth in range(1, AUTO_MAX_DEPTH + 1)] + [("layer", 1)]
    for kind, depth in candidates if granularity == "auto" else [granularity]:
        priced = price_graph(trace_model(bundle, granularity=kind, block_depth=depth).graph, profile)
        if granularity != "auto" or kind == "layer" or minimum_ram_bytes(priced) <= AUTO_FLOOR_SHARE * budget_bytes:
            return (kind, depth), priced
    raise AssertionError("unreachable: layer granularity is the last candidate")


# Every method row has these (None where they do not apply or the method could not run).
METHOD_FIELDS = ("s_per_step", "j_per_step", "energy_source", "peak_rss_bytes", "peak_rss_after_trim_bytes",
                 "process_rss_bytes", "tracked_bytes", "tracked_source", "fits_budget", "note")


def _method_row(model, batch_size, share, info, label, config, timing, memory, plain) -> dict:
    """One method at one share, with whether it gets under the budget (and a note saying why not, or what it is)."""
    row = {"model": model, "batch_size": batch_size, "budget_share": share, "method": label,
           **dict.fromkeys(METHOD_FIELDS), "s_per_step": timing.get("step_s"), "j_per_step": timing.get("energy_j"),
           "energy_source": timing.get("energy_source"),
           **{k: v for k, v in memory.items() if k not in ("error", "compiled_graphs")}}
    if config.get("segments"):
        row["segments"] = config["segments"]
    errors = [e for e in (timing.get("error"), memory.get("error")) if e]
    notes = []
    if errors:
        row["error"] = errors[0]
        notes.append(f"could not run here: {errors[0]}")
    tracked = row.get("tracked_bytes")
    if config["method"] == "poet":
        row["fits_budget"] = tracked is not None and tracked <= info["budget_bytes"] * 1.001
        notes.append("the executor holds its tracked bytes under the budget")
        # as the executor's process traced it (the solve's where that process failed)
        row.setdefault("granularity", info["compiled"]["granularity"] if config.get("inductor") else info["granularity"])
        if config.get("inductor"):
            notes.append(f"inductor kernels, {row['granularity']} nodes (not bitwise eager)")
        elif row["granularity"] != "layer":
            notes.append(f"{row['granularity']} nodes")
    elif tracked is None:
        row["fits_budget"] = None
    else:
        reference = plain.get("saved_tensor_bytes") if config["method"] == "compile" else plain.get("tracked_bytes")
        row["fits_budget"] = bool(reference) and tracked <= share * reference * 1.001
        row["share_of_plain"] = tracked / reference if reference else None
        if config["method"] == "plain":
            notes.append("the reference: keeps every activation")
        elif row["share_of_plain"] is not None:
            what = f"{100 * row['share_of_plain']:.0f}% of plain's {'saved' if config['method'] == 'compile' else 'tracked'} bytes"
            notes.append(what if row["fits_budget"] else f"cannot get under {_share_text(share)}: {what}")
    if config["method"] == "save_on_cpu":
        notes.append("CPU-only machine: saved tensors already live on the CPU, so this is plain training")
    if config["method"] == "compile":
        notes.append(f"activation_memory_budget={share}")
    row["note"] = "; ".join(notes)
    return row


# ----------------------------------------------------------------------------- main
def _parse_budgets(text: str) -> list[float]:
    shares = []
    for part in text.split(","):
        part = part.strip()
        value = float(part[:-1]) / 100 if part.endswith("%") else float(part)
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"a budget is a share of the no-remat peak in (0, 100%], got {part!r}")
        shares.append(value)
    return shares


def _parse_granularity(text: str) -> tuple[str, int] | str:
    """``auto``, ``layer`` or ``block:N`` (module-tree depth of a block: 1 is the coarsest) as (granularity, depth)."""
    if text == "auto":
        return text
    if text == "layer":
        return "layer", 1
    kind, _, depth = text.partition(":")
    if kind == "block" and depth.isdigit() and int(depth) >= 1:
        return "block", int(depth)
    raise argparse.ArgumentTypeError(f"a granularity is 'auto', 'layer' or 'block:N' with N >= 1, got {text!r}")


def _granularity_text(granularity: tuple[str, int]) -> str:
    return granularity[0] if granularity[0] == "layer" else f"block:{granularity[1]}"


def _mb(value) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"


def _print_overhead(model: str, args, batch_size: int, log) -> list[dict]:
    print(f"\n## 1. {model}: no memory pressure: keep-all schedule against plain PyTorch, batch {batch_size} "
          f"(each method in a process of its own, their steps taken in turn, in two rounds whose processes start in "
          f"opposite orders; medians of {args.overhead_steps} steps; "
          "ratio: median of the per-step ratios, with its quartiles; POET: the executor as users get it, node "
          "functions and every step after the first lowered to one straight-line program; autograd: the same "
          "executor with node_functions=False, every node under autograd (the executor before the lowering); "
          "floor: the same nodes run one by one with one autograd call each, without the executor's store, "
          "hooks and telemetry; us/instr: the overhead per instruction beyond plain PyTorch's step; faults: minor "
          "page faults per step, plain and POET, from memory the C heap gave back to the OS and touched again"
          + ("; with --compile, two more methods taking turns: POET --compile's keep-all and torch.compile of the "
             "whole model, each as a median ratio to plain (uncompiled: POET's ratio again)" if args.compile else "")
          + ")\n", file=log)
    print(f"{'allocator':<26} {'granularity':<12} {'nodes':>5} {'instr':>6} {'plain s/step':>13} "
          f"{'POET s/step':>12} {'ratio':>6} {'quartiles':>12} {'us/instr':>9} {'autograd':>9} {'us/instr':>9} "
          f"{'floor':>6} {'lowered':>8} {'faults':>13}"
          + (f" {'compiled':>9} {'uncompiled':>11} {'torch.compile':>14}" if args.compile else ""), file=log)
    rows = []
    for allocator in ("glibc default", "glibc keeps freed memory"):
        config = {"model": model, "batch_size": batch_size, "steps": args.overhead_steps, "threads": args.threads,
                  "compile": args.compile}
        for row in _spawn(config, mode="--run-overhead", allocator=allocator):
            print(f"{allocator:<26} {row['granularity']:<12} {row['nodes']:>5} {row['instructions']:>6} "
                  f"{row['plain_s']:>13.4f} {row['schedule_s']:>12.4f} {row['ratio']:>6.3f} "
                  f"{row['ratio_q1']:>5.3f}-{row['ratio_q3']:.3f} {row['overhead_us_per_instruction']:>9.1f} "
                  f"{row['autograd_ratio']:>9.3f} {row['autograd_overhead_us_per_instruction']:>9.1f} "
                  f"{row['floor_ratio']:>6.3f} {'yes' if row['lowered'] else 'no':>8} "
                  f"{row['plain_page_faults_per_step']:>6.0f}/{row['poet_page_faults_per_step']:<6.0f}"
                  + (f" {row['compiled_ratio']:>9.3f} {row['uncompiled_ratio']:>11.3f} {row['torch_compile_ratio']:>14.3f}"
                     if "compiled_ratio" in row else ""), file=log, flush=True)
            rows.append({"model": model, "batch_size": batch_size, "allocator": allocator,
                         "granularity": row["granularity"], "nodes": row["nodes"],
                         "instructions": row["instructions"], "plain_s_per_step": row["plain_s"],
                         "poet_s_per_step": row["schedule_s"], "ratio": row["ratio"], "ratio_q1": row["ratio_q1"],
                         "ratio_q3": row["ratio_q3"], "floor_ratio": row["floor_ratio"],
                         "overhead_us_per_instruction": row["overhead_us_per_instruction"],
                         "autograd_s_per_step": row["autograd_s"], "autograd_ratio": row["autograd_ratio"],
                         "autograd_overhead_us_per_instruction": row["autograd_overhead_us_per_instruction"],
                         "lowered": row["lowered"], "autograd_nodes": row["autograd_nodes"],
                         "plain_page_faults_per_step": row["plain_page_faults_per_step"],
                         "poet_page_faults_per_step": row["poet_page_faults_per_step"],
                         **{k: row[k] for k in ("compiled_ratio", "uncompiled_ratio", "torch_compile_ratio")
                            if k in row}})
    return rows


def _print_methods(args, info: dict, rows: list[dict], log) -> None:
    share = info["budget_share"]
    print(f"\n## 2. {info['model']}, batch {info['batch_size']}, at {_share_text(share)} of the no-remat peak "
          f"({info['budget_bytes'] / 1e6:.2f} MB of {info['no_remat_peak_bytes'] / 1e6:.2f} MB), POET at "
          f"{info['granularity']} granularity ({info['nodes']} nodes), "
          f"profile of this machine (quick{', calibrated on executor telemetry of this model' if info['calibrated'] else ''})"
          "\n", file=log)
    _print_solve("POET", info, args, log)
    if "compiled" in info:
        _print_solve(f"{COMPILED_POET} ({info['compiled']['granularity']}, {info['compiled']['nodes']} nodes)",
                     info["compiled"], args, log)
    sources = sorted({r["energy_source"] for r in rows if r.get("energy_source")})
    print(f"energy: {', '.join(sources) or '-'}; peak RSS: high-water above the step-start RSS in steady state (after "
          f"trim: in the steps right after the C heap is trimmed), allocator returning freed memory at once; tracked: "
          f"POET's executor, else live activation bytes (torch.compile: saved bytes); fits: tracked <= "
          f"{_share_text(share)} of plain's, counted alike (plain: {_mb(info.get('plain_tracked_bytes'))} MB)\n", file=log)
    print(f"{'method':<34} {'s/step':>8} {'J/step':>8} {'peak RSS MB':>12} {'after trim':>11} {'tracked MB':>11} "
          f"{'fits':>5}  note", file=log)
    for row in rows:
        label = row["method"] + (f" ({row['error'].split(':')[0]})" if row.get("error") else "")
        step_s = "-" if row.get("s_per_step") is None else f"{row['s_per_step']:.4f}"
        energy = "-" if row.get("j_per_step") is None else f"{row['j_per_step']:.3f}"
        fits = {True: "yes", False: "no", None: "-"}[row.get("fits_budget")]
        print(f"{label:<34} {step_s:>8} {energy:>8} {_mb(row.get('peak_rss_bytes')):>12} "
              f"{_mb(row.get('peak_rss_after_trim_bytes')):>11} {_mb(row.get('tracked_bytes')):>11} {fits:>5}  "
              f"{row.get('note', '')}", file=log)
    for field, what in (("peak_rss_bytes", "peak RSS"), ("peak_rss_after_trim_bytes", "peak RSS after a heap trim")):
        _print_verdict(rows, field, what, log)


def _print_verdict(rows: list[dict], field: str, what: str, log) -> None:
    """Whether an alternative at equal or lower memory (``field``, within 5%) spends less energy than POET."""
    rivals = [r for r in rows if r["method"] not in ("plain", "POET", COMPILED_POET) and r.get("j_per_step") is not None
              and r.get(field) is not None]
    for name in ("POET", COMPILED_POET):
        poet = next((r for r in rows if r["method"] == name and r.get("j_per_step") is not None), None)
        if poet is None or not rivals or poet.get(field) is None:
            continue
        within = [r for r in rivals if r[field] <= 1.05 * poet[field]]
        if within:
            best = min(within, key=lambda r: r["j_per_step"])
            print(f"\nat equal or lower {what} (within 5% of {name}'s {_mb(poet[field])} MB), the "
                  f"lowest-energy alternative is {best['method']}: {best['j_per_step'] / poet['j_per_step']:.2f}x "
                  f"{name}'s energy, {best['s_per_step'] / poet['s_per_step']:.2f}x its time", file=log)
        else:
            print(f"\nno alternative ran at or below {name}'s {what} ({_mb(poet[field])} MB, within 5%)", file=log)
        nearest = min(rivals, key=lambda r: abs(r[field] - poet[field]))
        print(f"nearest in memory: {nearest['method']} at {_mb(nearest[field])} MB: "
              f"{nearest['j_per_step'] / poet['j_per_step']:.2f}x {name}'s energy, "
              f"{nearest['s_per_step'] / poet['s_per_step']:.2f}x its time", file=log)


def _print_solve(name: str, solved: dict, args, log) -> None:
    if "counts" not in solved:
        print(f"{name}: no schedule ({solved['status']}: {solved['message']})", file=log)
        return
    gap = f", gap {100 * solved['gap']:.1f}%" if solved["gap"] else ""
    counts = solved["counts"]
    print(f"{name} schedule ({solved['status']}{gap}, runtime factor {args.runtime_budget}): "
          f"{counts['recomputes']} recomputes, {counts['page_outs']} page-outs, {counts['page_ins']} page-ins; "
          f"predicted {solved['predicted_runtime_s'] + solved['predicted_paging_s']:.4f} s, "
          f"{solved['predicted_energy_j']:.3f} J, peak {solved['predicted_peak_bytes'] / 1e6:.2f} MB", file=log)


def _failed(report: dict, model: str, part: int, error: BaseException, log) -> None:
    """A model's part that failed: its traceback on the log, its error in the report's ``errors``."""
    import traceback

    traceback.print_exception(error, file=log)
    report["errors"].append({"model": model, "part": part, "error": _error_text(error)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated zoo models (default {','.join(DEFAULT_MODELS)})")
    parser.add_argument("--model", help="one model (same as --models MODEL)")
    parser.add_argument("--budgets", type=_parse_budgets, default=[0.5, 0.3],
                        help="part 2: shares of the no-remat peak, e.g. 50%%,30%% (the default)")
    parser.add_argument("--batch-size", type=int, help="batch of part 2 (default per model: "
                        + ", ".join(f"{m} {b[1]}" for m, b in BATCH_SIZES.items()) + ")")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method in part 2 (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable on a shared machine)")
    parser.add_argument("--flash-dir", default=".")
    parser.add_argument("--overhead-batch-size", type=int, help="batch of part 1 (default per model: "
                        + ", ".join(f"{m} {b[0]}" for m, b in BATCH_SIZES.items()) + ")")
    parser.add_argument("--overhead-steps", type=int, default=30, help="timed steps of part 1 (default 30)")
    parser.add_argument("--runtime-budget", type=float, default=2.0, help="runtime factor of the solve (default 2)")
    parser.add_argument("--time-limit", type=float, default=120.0, help="solver time limit, seconds")
    parser.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                        help="solve part 2 on the quick local profile as measured, without fitting it to the "
                             "executor's telemetry first")
    parser.add_argument("--no-paging", dest="paging", action="store_false", help="part 2: POET recomputes only")
    parser.add_argument("--compile", action="store_true",
                        help=f"also run '{COMPILED_POET}', POET with its node functions through inductor (fused "
                             "kernels, not bitwise eager): part 2 solves it at --compile-granularity, part 1 times its "
                             "keep-all and torch.compile against plain in a second round")
    parser.add_argument("--compile-granularity", type=_parse_granularity, default="auto",
                        help="nodes of the --compile rows: layer, block:N, or auto (the default): per budget, the "
                             f"coarsest block depth whose largest node's inputs, output and workspace take at most "
                             f"{100 * AUTO_FLOOR_SHARE:.0f}%% of the budget (inductor fuses within a node, and each compiled "
                             "call costs more than an uncompiled one)")
    parser.add_argument("--granularity", type=_parse_granularity, default=("layer", 1),
                        help="nodes of the POET rows of part 2: layer (the default, as `poet solve`), block:N, or "
                             "auto (per budget, as --compile-granularity auto)")
    parser.add_argument("--part", type=int, choices=[1, 2, 3], help="run only this part (default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout; tables go to stderr")
    parser.add_argument("--run-timed", help=argparse.SUPPRESS)
    parser.add_argument("--run-peak", help=argparse.SUPPRESS)
    parser.add_argument("--run-overhead", help=argparse.SUPPRESS)
    parser.add_argument("--run-overlap", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_timed:
        print(json.dumps(run_timed(json.loads(args.run_timed))))
        return
    if args.run_peak:
        print(json.dumps(run_peak(json.loads(args.run_peak))))
        return
    if args.run_overlap:
        config = json.loads(args.run_overlap)
        print(json.dumps(overlap_rows(config["model"], config["batch_size"], config["share"], config["steps"],
                                      config["threads"], config["flash_dir"], config["time_limit_s"])))
        return
    if args.run_overhead:
        config = json.loads(args.run_overhead)
        print(json.dumps(overhead_rows(config["model"], config["batch_size"], config["steps"], config["threads"],
                                       config.get("compile", False))))
        return
    models = [args.model] if args.model else [m.strip() for m in args.models.split(",") if m.strip()]
    log = sys.stderr if args.json else sys.stdout
    torch.set_num_threads(args.threads)
    print(f"# Executor benchmark: {', '.join(models)}, {args.threads} torch thread(s), torch {torch.__version__}",
          file=log)
    report = {"torch": torch.__version__, "threads": args.threads, "models": models, "budget_shares": args.budgets,
              "overhead": [], "methods": [], "budgets": [], "overlap": [], "errors": []}
    if args.part in (None, 1):
        for model in models:
            batch_size = args.overhead_batch_size or BATCH_SIZES.get(model, (128, 64))[0]
            try:
                report["overhead"] += _print_overhead(model, args, batch_size, log)
            except Exception as error:  # noqa: BLE001 - one model failing leaves the others' rows in the report
                _failed(report, model, 1, error, log)
    if args.part in (None, 2):
        from host.costs.local_bench import profile_local_machine

        print("\nprofiling this machine (quick)", file=log, flush=True)
        measured_profile = profile_local_machine(args.flash_dir, quick=True)
        for model in models:
            batch_size = args.batch_size or BATCH_SIZES.get(model, (128, 64))[1]
            try:
                infos, rows = budget_rows(args, model, batch_size, args.budgets, measured_profile, log)
            except Exception as error:  # noqa: BLE001
                _failed(report, model, 2, error, log)
                continue
            for info in infos:
                _print_methods(args, info, [r for r in rows if r["budget_share"] == info["budget_share"]], log)
            report["budgets"] += infos
            report["methods"] += rows
        print("\nnote: torch.utils.checkpoint (and selective checkpointing) recomputes BatchNorm forwards and so moves "
              "the running statistics twice per step; POET's recomputations do not.", file=log)
    if args.part in (None, 3):
        for model in models:
            batch_size = args.batch_size or BATCH_SIZES.get(model, (128, 64))[1]
            try:
                report["overlap"] += _print_overlap(model, args, batch_size, log)
            except Exception as error:  # noqa: BLE001
                _failed(report, model, 3, error, log)
    if args.json:
        print(json.dumps(report, default=str))
    if report["errors"]:
        failed = ", ".join(f"{e['model']} part {e['part']}" for e in report["errors"])
        raise SystemExit(f"failed: {failed}")


if __name__ == "__main__":
    main()
