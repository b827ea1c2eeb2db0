"""Shared set-up for the executor tests: traced test models (traced once) and schedules of every kind."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from device_agent.executor import EventStream, Partition, ScheduleExecutor, plain_train_step
from host.costs import load_profile, price_graph
from host.graph.partition import partition_from_traced
from host.graph.trace import TracedModel, trace_model
from host.graph.zoo import ModelBundle, get_model_spec
from host.solver.solve import SolveOptions, no_remat_peak_bytes, solve_schedule

# Small batches and coarse-enough granularity keep every MILP solve well under a second.
MODELS = {
    "mlp": dict(batch_size=4, granularity="layer", block_depth=1, share=0.8, mixed=("a72", 2.0)),
    "resnet18_cifar": dict(batch_size=2, granularity="block", block_depth=2, share=0.75, mixed=("jetsontx2", 1.5)),
    "hf_bert": dict(batch_size=2, granularity="block", block_depth=4, share=0.72, mixed=("m0", 2.0)),
}
# schedule kind -> (profile, solve options): a72 pages slowly (favours recomputation), m0 computes slowly
KINDS = {
    "none": ("a72", {}),
    "remat": ("a72", dict(paging=False)),
    "paging": ("m0", dict(remat=False)),
    "mixed": (None, {}),
}


@dataclass
class Case:
    name: str
    bundle: ModelBundle  # the traced model; its module is reset to ``initial_state`` before each run
    traced: TracedModel
    partition: Partition
    initial_state: dict[str, torch.Tensor]
    config: dict

    def reset(self) -> None:
        self.bundle.module.load_state_dict(self.initial_state)

    def plain_bundle(self) -> ModelBundle:
        return get_model_spec(self.name).bundle(self.config["batch_size"], seed=0)


@functools.cache
def case(name: str) -> Case:
    config = MODELS[name]
    bundle = get_model_spec(name).bundle(config["batch_size"], seed=0)
    traced = trace_model(bundle, granularity=config["granularity"], block_depth=config["block_depth"])
    initial = {k: v.detach().clone() for k, v in bundle.module.state_dict().items()}
    return Case(name, bundle, traced, partition_from_traced(traced), initial, config)


@functools.cache
def schedule_for(name: str, kind: str):
    """A validated schedule of ``kind`` for model ``name`` (and the budget it was solved for)."""
    current = case(name)
    platform, options = KINDS[kind]
    runtime_factor = 2.0
    if kind == "mixed":
        platform, runtime_factor = current.config["mixed"]
    priced = price_graph(current.traced.graph, load_profile(platform))
    peak = no_remat_peak_bytes(priced)
    budget = float(peak) if kind == "none" else current.config["share"] * peak
    result = solve_schedule(
        priced, SolveOptions(ram_budget_bytes=budget, runtime_factor=runtime_factor, time_limit_s=30, **options)
    )
    assert result.status in ("optimal", "feasible"), result.message
    return result.schedule, budget


def make_optimizer(kind: str, module: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(module.parameters(), lr=1e-3)


def param_diff(module_a: torch.nn.Module, module_b: torch.nn.Module) -> tuple[float, bool]:
    """(max relative difference over parameters and buffers, bitwise equal)."""
    worst, bitwise = 0.0, True
    pairs = list(zip(module_a.named_parameters(), module_b.named_parameters(), strict=True))
    pairs += list(zip(module_a.named_buffers(), module_b.named_buffers(), strict=True))
    for (name, a), (other, b) in pairs:
        assert name == other
        if torch.equal(a, b):
            continue
        bitwise = False
        diff = float((a.detach().double() - b.detach().double()).abs().max())
        scale = float(b.detach().double().abs().max())
        worst = max(worst, diff / scale if scale else float("inf"))
    return worst, bitwise


def run_scheduled(current: Case, schedule, *, steps: int, optimizer: str, flash_dir, partition=None,
                  events: EventStream | None = None, seed: int = 1, **options):
    current.reset()
    opt = make_optimizer(optimizer, current.bundle.module)
    torch.manual_seed(seed)
    results = []
    with ScheduleExecutor(partition or current.partition, schedule, flash_dir=str(flash_dir), events=events,
                          **options) as ex:
        for _ in range(steps):
            results.append(ex.train_step(current.bundle.inputs, current.bundle.labels, opt))
    return results


def run_plain(current: Case, *, steps: int, optimizer: str, seed: int = 1):
    plain = current.plain_bundle()
    opt = make_optimizer(optimizer, plain.module)
    torch.manual_seed(seed)
    losses = [plain_train_step(plain.module, plain.loss_fn, plain.inputs, plain.labels, opt) for _ in range(steps)]
    return plain, losses


def without(partition: Partition, **changes) -> Partition:
    """A copy of ``partition`` whose programs have ``changes`` applied (e.g. random=False)."""
    programs = {i: dataclasses.replace(p, **changes) for i, p in partition.programs.items()}
    return dataclasses.replace(partition, programs=programs)
