"""Program: the unit passes transform — a GraphModule, its model spec, its I/O signature and what it provides."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fxllm.runtime.contract import ModelSpec, TensorSig


@dataclass(frozen=True)
class AppliedPass:
    name: str
    options: dict[str, Any]


@dataclass
class Program:
    """A graph in a known calling convention. Placeholders appear in `inputs` order; the output is a flat tuple in
    `outputs` order. `facts` are what passes provided so far (e.g. 'kv-cache'), checked against pass requirements."""

    graph_module: torch.fx.GraphModule
    spec: ModelSpec
    inputs: list[TensorSig]
    outputs: list[TensorSig]
    facts: set[str] = field(default_factory=set)
    applied: list[AppliedPass] = field(default_factory=list)
    tokenizer: Any = None  # the source's tokenizer, for passes that need text (quantize's calibration)
    source_file: Any = None  # the source's GGUF file (a Path), for passes that keep its quantized blocks
    diagnostics: dict[str, Any] = field(default_factory=dict)  # what the last pass wants in its dump (per-layer...)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def placeholder(self, name: str) -> torch.fx.Node:
        for node in self.graph.nodes:
            if node.op == "placeholder" and node.name == name:
                return node
        raise KeyError(f"graph has no input '{name}'")

    def output_node(self) -> torch.fx.Node:
        return next(n for n in reversed(self.graph.nodes) if n.op == "output")
