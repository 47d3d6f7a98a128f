"""Decode attention on ONNX Runtime's CPU: GroupQueryAttention against the same step in standard ops, by context.

The `ort` lowering's contiguous cache is one com.microsoft.GroupQueryAttention per layer (packed q/k/v in, rotary
inside, the new row written into a preallocated buffer in place). This measures that op against the form it
replaced, written the cheapest way standard ops allow: Split, two RotaryEmbeddings, the new row written into the
same buffers in place by ScatterND (present bound onto past, as the runtime binds GroupQueryAttention's), then
FusedMatMul(q, K, transB) → Add(mask) → Softmax → MatMul(·, V) over the buffer's `capacity` rows. One graph of
`--layers` such layers, one decode token (S = 1), batch 1; the buffers hold `context` valid rows of `capacity`.

    .venv/bin/python benchmarks/decode_attention.py                      # SmolLM2's shapes, 2 threads
    .venv/bin/python benchmarks/decode_attention.py --contexts 64,1024 --capacity-factor 2

It prints ms per token for the layers (median of --rounds rounds of --calls calls) and the standard form's ratio to
GroupQueryAttention measured in the same run. It times attention alone (no projections), so it bounds what a
lowering change could move, not a model's ms/token.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from decode import parse_contexts


def build(form: str, layers: int, q_heads: int, kv_heads: int, head_dim: int, capacity: int, max_positions: int):
    """The ONNX model (bytes) of `layers` decode attentions in `form` ("gqa" or "standard")."""
    from onnx import TensorProto, helper, numpy_helper

    value = helper.make_tensor_value_info
    groups = q_heads // kv_heads
    packed = (q_heads + 2 * kv_heads) * head_dim
    cache = [1, kv_heads, capacity, head_dim]
    inputs = [value("qkv", TensorProto.FLOAT, [1, 1, packed]), value("seqlens_k", TensorProto.INT32, [1]),
              value("total", TensorProto.INT32, []), value("position_ids", TensorProto.INT64, [1, 1]),
              value("bias", TensorProto.FLOAT, [1, 1, 1, capacity]),
              value("rows", TensorProto.INT64, [1, kv_heads, 1, 3])]
    outputs, nodes = [], []
    rng = np.random.default_rng(1)
    tables = [numpy_helper.from_array(rng.standard_normal((max_positions, head_dim // 2)).astype(np.float32), name)
              for name in ("cos", "sin")]

    def constant(name: str, values: list[int]) -> None:
        nodes.append(helper.make_node("Constant", [], [name], value=helper.make_tensor(
            name, TensorProto.INT64, [len(values)], values)))

    constant("split_sizes", [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    constant("kv_rows_shape", [1, 1, kv_heads, head_dim])
    constant("q_groups_shape", [1, kv_heads, groups, head_dim])
    constant("out_shape", [1, 1, q_heads * head_dim])
    for layer in range(layers):
        past_k, past_v = f"past_k{layer}", f"past_v{layer}"
        present_k, present_v = f"present_k{layer}", f"present_v{layer}"
        inputs += [value(past_k, TensorProto.FLOAT, cache), value(past_v, TensorProto.FLOAT, cache)]
        outputs += [value(present_k, TensorProto.FLOAT, cache), value(present_v, TensorProto.FLOAT, cache)]
        out = f"out{layer}"
        if form == "gqa":
            nodes.append(helper.make_node(
                "GroupQueryAttention", ["qkv", "", "", past_k, past_v, "seqlens_k", "total", "cos", "sin"],
                [out, present_k, present_v], domain="com.microsoft", num_heads=q_heads, kv_num_heads=kv_heads,
                do_rotary=1))
            continue

        def n(name: str, layer: int = layer) -> str:
            return f"{name}{layer}"

        nodes += [
            helper.make_node("Split", ["qkv", "split_sizes"], [n("q"), n("k"), n("v")], axis=-1),
            helper.make_node("RotaryEmbedding", [n("q"), "position_ids", "cos", "sin"], [n("q_rot")],
                             domain="com.microsoft", num_heads=q_heads),
            helper.make_node("RotaryEmbedding", [n("k"), "position_ids", "cos", "sin"], [n("k_rot")],
                             domain="com.microsoft", num_heads=kv_heads),
            helper.make_node("Reshape", [n("k_rot"), "kv_rows_shape"], [n("k_rows")]),
            helper.make_node("Transpose", [n("k_rows")], [n("k_heads")], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [n("v"), "kv_rows_shape"], [n("v_rows")]),
            helper.make_node("Transpose", [n("v_rows")], [n("v_heads")], perm=[0, 2, 1, 3]),
            helper.make_node("ScatterND", [past_k, "rows", n("k_heads")], [present_k]),
            helper.make_node("ScatterND", [past_v, "rows", n("v_heads")], [present_v]),
            helper.make_node("Reshape", [n("q_rot"), "q_groups_shape"], [n("q_groups")]),
            helper.make_node("FusedMatMul", [n("q_groups"), present_k], [n("scores")], domain="com.microsoft",
                             transB=1, alpha=1 / float(np.sqrt(head_dim))),
            helper.make_node("Add", [n("scores"), "bias"], [n("masked")]),
            helper.make_node("Softmax", [n("masked")], [n("probs")], axis=-1),
            helper.make_node("MatMul", [n("probs"), present_v], [n("heads_out")]),
            helper.make_node("Reshape", [n("heads_out"), "out_shape"], [out]),
        ]
    last = value(f"out{layers - 1}", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, form, inputs, [last] + outputs, initializer=tables)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def measure(form: str, args, context: int, capacity: int) -> float:
    """Median ms of one call (all layers) over args.rounds rounds of args.calls calls."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.log_severity_level = 3
    model = build(form, args.layers, args.q_heads, args.kv_heads, args.head_dim, capacity, 2 * capacity)
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    bias = np.zeros((1, 1, 1, capacity), np.float32)
    bias[..., context:] = np.finfo(np.float32).min
    feeds = {"qkv": rng.standard_normal((1, 1, (args.q_heads + 2 * args.kv_heads) * args.head_dim), np.float32),
             "seqlens_k": np.array([context - 1], np.int32), "total": np.array(context, np.int32),
             "position_ids": np.array([[context - 1]], np.int64), "bias": bias,
             "rows": np.array([[[[0, h, context - 1]] for h in range(args.kv_heads)]], np.int64)}
    binding = session.io_binding()
    wanted = {i.name for i in session.get_inputs()}
    for name, array in feeds.items():
        if name in wanted:
            binding.bind_cpu_input(name, array)
    buffers = []  # present_* bound onto past_*: the step writes its row in place, as the runtime binds them
    for layer in range(args.layers):
        for kind in ("k", "v"):
            buffer = ort.OrtValue.ortvalue_from_numpy(
                rng.standard_normal((1, args.kv_heads, capacity, args.head_dim), np.float32))
            buffers.append(buffer)
            binding.bind_ortvalue_input(f"past_{kind}{layer}", buffer)
            binding.bind_ortvalue_output(f"present_{kind}{layer}", buffer)
    binding.bind_output(f"out{args.layers - 1}")
    for _ in range(5):
        session.run_with_iobinding(binding)
    rounds = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(args.calls):
            session.run_with_iobinding(binding)
        rounds.append((time.perf_counter() - start) / args.calls * 1e3)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=parse_contexts, default=[64, 256, 1024],
                        help="valid cache rows, comma-separated")
    parser.add_argument("--capacity-factor", type=float, default=1.0,
                        help="buffer rows = context x this (1: the buffer holds exactly the context)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    if args.q_heads % args.kv_heads or args.head_dim % 16:
        parser.error("--q-heads must be a multiple of --kv-heads and --head-dim of 16")
    if args.capacity_factor < 1 or min(args.layers, args.rounds, args.calls) < 1:
        parser.error("--capacity-factor, --layers, --rounds and --calls must be at least 1")
    print(f"{args.layers} layers, {args.q_heads} query / {args.kv_heads} KV heads of {args.head_dim}, "
          f"{args.threads} threads, one decode token, median of {args.rounds} x {args.calls} calls")
    print("| context | capacity | GroupQueryAttention ms | standard ops ms | standard / GQA |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for context in args.contexts:
        capacity = max(context, round(context * args.capacity_factor))
        gqa, standard = measure("gqa", args, context, capacity), measure("standard", args, context, capacity)
        print(f"| {context:,} | {capacity:,} | {gqa:.3f} | {standard:.3f} | {standard / gqa:.2f}x |")


if __name__ == "__main__":
    main()
