"""A ServerApp: FedAvg wrapped in :class:`~host.flower.PoetStrategy`, with SecAgg+ on by default.

Configured by the run config (``flwr run . -c 'poet-model="mlp" poet-ram-budget="auto"'``), keys in
:data:`RUN_CONFIG`. After the last round it writes ``poet-report`` (JSON: per round each node's figures, the
nodes left out) and, beside it, the final global weights as ``.npz`` (named as the model's state_dict).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common import parameters_to_ndarrays
from flwr.server import LegacyContext, ServerApp, ServerConfig
from flwr.server.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

from host.flower.strategy import PoetStrategy

__all__ = ["RUN_CONFIG", "SECAGG_QUANTIZATION_RANGE", "app", "run_config", "write_report"]

RUN_CONFIG: dict[str, Any] = {
    "num-rounds": 3,
    "poet-model": "mlp",  # a zoo name or module:callable, traced on the server
    "poet-batch-size": 32,
    "poet-ram-budget": "auto",  # for nodes that do not name their own: bytes, a unit, a share of the peak, auto
    "poet-steps": 10,  # local steps per round
    "poet-lr": 0.05,
    "poet-optimizer": "sgd",
    "poet-seed": 0,
    "poet-runtime-budget": 1.2,
    "poet-plain": False,  # the same app, trained with ordinary PyTorch
    "poet-secagg": True,  # SecAgg+ (the nodes' ClientApp must carry secaggplus_mod)
    # Central DP with client-side fixed clipping (Flower's DifferentialPrivacyClientSideFixedClipping; the nodes'
    # ClientApp must carry fixedclipping_mod): the clipping norm of each node's update (0: off) and the noise.
    "poet-dp-clipping-norm": 0.0,
    "poet-dp-noise-multiplier": 0.0,
    "poet-min-nodes": 2,
    "poet-work-dir": "",  # required: the server's traced model, schedule cache and planner store
    "poet-report": "",  # where to write the JSON report ("" for none)
}
# SecAgg+ quantizes each node's weights to integers before masking (stochastic rounding). Flower's default
# range, 2**22 over [-8, 8], leaves steps of 3.8e-6; 2**26 gives 2.4e-7 (float32 weights above -6 then map to
# integers exactly, with nothing left to round), well inside the 1e-5 relative agreement with plain training
# the demo checks, and 2**26 x up to 64 nodes still fits the 2**32 modulus.
SECAGG_QUANTIZATION_RANGE = 2**26


def run_config(context_config: dict[str, Any]) -> dict[str, Any]:
    """RUN_CONFIG's defaults with the run's values over them (ValueError for an unknown key)."""
    config = dict(RUN_CONFIG)
    unknown = sorted(k for k in context_config if k.startswith("poet-") and k not in RUN_CONFIG)
    if unknown:
        raise ValueError(f"unknown run config keys {unknown}; known: {sorted(RUN_CONFIG)}")
    config.update(context_config)
    if not config["poet-work-dir"]:
        raise ValueError("the run config needs poet-work-dir (a directory on the server for the traced model and "
                         "the schedule cache)")
    return config


def write_report(strategy: PoetStrategy, path: str | Path, **extra: Any) -> None:
    """The strategy's report (with ``extra``) as JSON at ``path``, its final weights at ``path`` with suffix .npz."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if strategy.parameters is not None:
        arrays = parameters_to_ndarrays(strategy.parameters)
        np.savez(path.with_suffix(".npz"), **dict(zip(strategy.weight_names, arrays, strict=True)))
    path.write_text(json.dumps({**strategy.report(), **extra}, indent=2) + "\n")


app = ServerApp()


@app.main()
def main(grid, context) -> None:
    config = run_config(dict(context.run_config))
    nodes = int(config["poet-min-nodes"])
    inner = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=nodes, min_available_clients=nodes)
    if float(config["poet-dp-clipping-norm"]) > 0:
        inner = DifferentialPrivacyClientSideFixedClipping(
            inner, noise_multiplier=float(config["poet-dp-noise-multiplier"]),
            clipping_norm=float(config["poet-dp-clipping-norm"]), num_sampled_clients=nodes)
    strategy = PoetStrategy(
        inner, model=str(config["poet-model"]), work_dir=str(config["poet-work-dir"]),
        ram_budget=config["poet-ram-budget"], steps=int(config["poet-steps"]), lr=float(config["poet-lr"]),
        optimizer=str(config["poet-optimizer"]), batch_size=int(config["poet-batch-size"]) or None,
        seed=int(config["poet-seed"]), runtime_budget=float(config["poet-runtime-budget"]),
        plain=bool(config["poet-plain"]),
    )
    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=int(config["num-rounds"])),
                           strategy=strategy)
    fit_workflow = None
    if config["poet-secagg"]:
        # Every node's weights, scaled by its share of examples before quantizing: with max_weight the examples
        # a node trains on per round, that share is 1 and no precision is lost to it.
        fit_workflow = SecAggPlusWorkflow(num_shares=1.0, reconstruction_threshold=1.0,
                                          quantization_range=SECAGG_QUANTIZATION_RANGE,
                                          max_weight=float(strategy.examples_per_round))
    DefaultWorkflow(fit_workflow=fit_workflow)(grid, legacy)
    if config["poet-report"]:
        write_report(strategy, config["poet-report"], secure_aggregation=bool(config["poet-secagg"]),
                     dp_clipping_norm=float(config["poet-dp-clipping-norm"]),
                     dp_noise_multiplier=float(config["poet-dp-noise-multiplier"]))
