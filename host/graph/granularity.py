"""How traced ops are grouped into schedulable nodes: the granularity values and their one parser.

- ``layer``: one node per leaf module call, plus top-level ops such as residual adds (the default);
- ``block``: module paths cut at the top level (``block:1``); ``block:N`` cuts them at depth N, so larger N
  gives more, smaller nodes (hf_bert: 7 nodes at ``block``, 38 at ``block:5``, 82 at ``layer``);
- ``op``: one node per non-view aten op.

Coarser nodes make fewer calls per training step (the executor bench's part 1: hf_bert 0.92-0.95x plain
PyTorch at block granularity against 1.01x at layer), but each node's inputs and output must fit the RAM
budget together, and the solver has fewer places to free memory.
"""

from __future__ import annotations

GRANULARITIES: tuple[str, ...] = ("layer", "block", "op")  # the kinds; "block:N" is a block at depth N
GRANULARITY_HELP = ("how traced ops are grouped into schedulable nodes: layer, block (top-level modules), block:N "
                    "(module paths cut at depth N: more, smaller nodes as N grows) or op (default: layer)")


def parse_granularity(text: str) -> tuple[str, int]:
    """(kind, block depth) of ``text``: layer, op, block (= block:1) or block:N with N >= 1; ValueError otherwise."""
    kind, colon, depth = str(text).partition(":")
    if kind in GRANULARITIES and not colon:
        return kind, 1
    if kind == "block" and depth.isdigit() and int(depth) >= 1:
        return kind, int(depth)
    raise ValueError(f"granularity {str(text)[:40]!r} is not one of layer, block, block:N (N >= 1, the module-path "
                     "depth of a block) or op")


def granularity_text(kind: str, block_depth: int = 1) -> str:
    """The canonical text of a granularity: ``block`` for depth 1 (what earlier releases wrote), ``block:N`` else."""
    return f"block:{block_depth}" if kind == "block" and block_depth > 1 else kind
