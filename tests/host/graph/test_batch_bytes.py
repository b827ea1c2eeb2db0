"""The batch is held by the caller for the whole step: fixed bytes, never a schedulable tensor."""

from host.graph.trace import trace_model
from host.graph.zoo import get_model_spec


def _batch_and_labels_bytes(bundle) -> int:
    return sum(t.numel() * t.element_size() for t in (*bundle.inputs, bundle.labels))


def test_the_batch_is_fixed_bytes_not_a_free_node():
    large, small = (get_model_spec("mlp").bundle(size, seed=0) for size in (8, 4))
    large_graph, small_graph = trace_model(large).graph, trace_model(small).graph
    assert large_graph.nodes[0].op_class == "input"
    assert large_graph.nodes[0].output_bytes == 0
    # the fixed bytes grow with the batch by exactly the batch and its labels
    assert (large_graph.other_fixed_bytes - small_graph.other_fixed_bytes
            == _batch_and_labels_bytes(large) - _batch_and_labels_bytes(small))
