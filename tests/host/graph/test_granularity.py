"""The granularity values users pass (--granularity, ModelSource, SubmitRun) and their canonical text."""

from __future__ import annotations

import pytest

from host.graph.granularity import granularity_text, parse_granularity
from host.run.errors import InputError
from host.run.sources import ModelSource


@pytest.mark.parametrize(("text", "parsed", "canonical"), [
    ("layer", ("layer", 1), "layer"), ("op", ("op", 1), "op"), ("block", ("block", 1), "block"),
    ("block:1", ("block", 1), "block"), ("block:5", ("block", 5), "block:5"),
])
def test_each_granularity_parses_to_its_kind_and_depth(text, parsed, canonical):
    assert parse_granularity(text) == parsed
    assert granularity_text(*parsed) == canonical


@pytest.mark.parametrize("text", ["blocks", "block:", "block:0", "block:-1", "block:x", "layer:2", "op:1", "", "BLOCK"])
def test_a_malformed_granularity_is_refused_with_every_form_named(text):
    with pytest.raises(ValueError, match=r"layer, block, block:N .* or op"):
        parse_granularity(text)


def test_a_model_source_keeps_the_canonical_text_and_refuses_bad_values():
    assert ModelSource("mlp", granularity="block:1").granularity == "block"
    assert ModelSource("mlp", granularity="block:3").granularity == "block:3"
    with pytest.raises(InputError, match="block:N"):
        ModelSource("mlp", granularity="block:0")
