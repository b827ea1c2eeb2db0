"""LSTM/GRU/RNN unrolled per time step at export: same training as eager, one node per cell, a low floor."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from device_agent.executor.split import make_schedulable
from host.costs.pricing import price_graph
from host.costs.profile import load_profile
from host.graph.export import export_program
from host.graph.recurrent import RECURRENT_STEP_META_KEY
from host.graph.trace import trace_model
from host.graph.zoo import ModelBundle, default_loss
from host.solver.solve import minimum_ram_bytes, no_remat_peak_bytes

RECURRENT_OPS = ("aten.lstm.", "aten.gru.", "aten.rnn_tanh.", "aten.rnn_relu.")


class Classifier(nn.Module):
    """A recurrent layer, then a Linear on its last step plus its final hidden state (both outputs used)."""

    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn
        width = (rnn.proj_size or rnn.hidden_size) * (2 if rnn.bidirectional else 1)
        self.fc = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = self.rnn(x)
        h = state[0] if isinstance(state, tuple) else state
        last = out[:, -1] if self.rnn.batch_first else out[-1]
        return self.fc(last) + h.sum(0).mean()


def bundle(rnn: nn.RNNBase, steps: int = 7, batch: int = 4) -> ModelBundle:
    torch.manual_seed(0)
    model = Classifier(rnn)
    shape = (batch, steps, rnn.input_size) if rnn.batch_first else (steps, batch, rnn.input_size)
    return ModelBundle("rnn", model, (torch.randn(*shape),), torch.randint(0, 3, (batch,)), default_loss)


def recurrent_ops(program: torch.export.ExportedProgram) -> list[str]:
    return [str(n.target) for n in program.graph.nodes if str(n.target).startswith(RECURRENT_OPS)]


CONFIGS = {
    "lstm batch_first": lambda: nn.LSTM(6, 8, batch_first=True),
    "lstm 2 layers bidirectional": lambda: nn.LSTM(6, 8, num_layers=2, bidirectional=True),
    "lstm projection no bias": lambda: nn.LSTM(6, 8, proj_size=5, bias=False, batch_first=True),
    "gru 2 layers bidirectional": lambda: nn.GRU(6, 8, num_layers=2, bidirectional=True, batch_first=True),
    "rnn relu": lambda: nn.RNN(6, 8, nonlinearity="relu"),
    "rnn tanh 2 layers": lambda: nn.RNN(6, 8, num_layers=2),
}


@pytest.mark.parametrize("make", CONFIGS.values(), ids=CONFIGS.keys())
def test_unrolled_program_trains_as_the_eager_layer(make):
    """Loss, gradients and an SGD step of the unrolled program match eager nn.LSTM/GRU/RNN (verify: 1e-6)."""
    b = bundle(make())
    program = export_program(b)
    assert recurrent_ops(program) == []
    gm = make_schedulable(program.module())
    reference = copy.deepcopy(b.module)
    loss = gm(*b.inputs, labels=b.labels)
    loss.backward()
    expected = default_loss(reference(*b.inputs), b.labels)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    ours = dict(gm.named_parameters())
    for name, param in reference.named_parameters():
        grad = ours[f"model.{name}"].grad
        assert (grad - param.grad).abs().max() <= 1e-5 * param.grad.abs().max(), name
        stepped, eager = ours[f"model.{name}"] - 0.1 * grad, param - 0.1 * param.grad
        assert (stepped - eager).abs().max() <= 1e-6 * eager.abs().max(), name


def test_every_unrolled_op_names_its_cell_and_a_board_rebuilds_the_same_program():
    b = bundle(nn.LSTM(6, 8, num_layers=2, bidirectional=True, batch_first=True), steps=3)
    program = export_program(b)
    added = [n for n in program.graph.nodes if RECURRENT_STEP_META_KEY in n.meta]
    steps = {n.meta[RECURRENT_STEP_META_KEY] for n in added}
    cells = {f"l{layer}.{d}t{t}" for layer in (0, 1) for d in ("", "r.") for t in range(3)}
    assert cells | {f"{c}.h" for c in cells} | {"out"} == steps
    assert all(n.meta["nn_module_stack"] and "rnn" in list(n.meta["nn_module_stack"].values())[-1][0] for n in added)
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    host = make_schedulable(program.module())
    board = make_schedulable(torch.export.load(buffer).module())
    assert [(n.name, str(n.target)) for n in board.graph.nodes] == [(n.name, str(n.target)) for n in host.graph.nodes]
    assert torch.equal(board(*b.inputs, labels=b.labels), host(*b.inputs, labels=b.labels))


def test_dropout_between_stacked_layers_stays_one_op():
    """Its random draws could not match eager's, so a training LSTM with inter-layer dropout is left fused."""
    b = bundle(nn.LSTM(6, 8, num_layers=2, dropout=0.5))
    assert recurrent_ops(export_program(b)) == ["aten.lstm.input"]
    b.module.eval()
    assert recurrent_ops(export_program(b)) == []


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_layer_granularity_gives_a_node_per_time_step_and_a_floor_far_below_the_peak(cell):
    """A recurrent layer was one node whose floor was its no-remat peak; per step, the floor is the output's."""
    steps = 20
    graph = trace_model(bundle(cell(8, 32, batch_first=True), steps=steps, batch=8)).graph
    names = [n.name for n in graph.nodes if n.kind == "fwd" and n.name.startswith("rnn")]
    width = len(str(steps - 1))
    assert names == [f"rnn.l0.t{t:0{width}d}{h}" for t in range(steps) for h in ("", ".h")] + ["rnn.out"]
    assert all(graph.nodes[graph.index_of(n)].op_class == "matmul" for n in names[:-1:2])
    priced = price_graph(graph, load_profile("a72"))
    assert minimum_ram_bytes(priced) < 0.35 * no_remat_peak_bytes(priced)


def test_block_granularity_keeps_the_layer_whole():
    graph = trace_model(bundle(nn.GRU(6, 8)), granularity="block").graph
    assert [n.name for n in graph.nodes if n.kind == "fwd" and n.name.startswith("rnn")] == ["rnn"]


@pytest.mark.slow
def test_an_lstm_trains_exactly_under_a_binding_budget(tmp_path):
    """Scheduled (remat and paging of cells) against eager nn.LSTM; also the memory the trace predicts: a
    gradient that is a view of a stacked output's gradient is held as its whole storage."""
    from poet_edge import verify

    b = bundle(nn.LSTM(6, 16, batch_first=True), steps=6)
    report = verify(b.module, "a72", "60%", inputs=b.inputs, labels=b.labels, steps=2, flash_dir=tmp_path,
                    time_limit_s=10)
    assert report.ok, report
    assert report.max_rel_param_diff <= 1e-6


def test_a_gradient_that_views_a_stacked_gradient_is_priced_as_its_storage():
    """The output stack's backward returns each step's gradient as a view of one [T, B, H] storage (and h_T,
    read again for h_n, a sum of its own): the executor holds the storages, so the graph prices them."""
    steps, batch, hidden = 5, 4, 8
    graph = trace_model(bundle(nn.GRU(6, hidden), steps=steps, batch=batch)).graph
    assert graph.nodes[graph.index_of("bwd:rnn.out")].output_bytes == (steps + 1) * batch * hidden * 4
