"""Models shaped like those the peers' own converter test suites convert (onnxconverter-common's
float16 tests, ModelOpt AutoCast's precision-converter tests), built here from their
structure: subgraphs reading outer values, nested and chained Ifs, empty tensors, Resize
scales and sizes computed in the graph, casts from inputs to outputs, a custom-domain op,
constants beyond fp16's range, symbolic dims, duplicate node names, untyped outputs.

Each goes through the CLI in fp16 and bf16 and must exit 0 with an output that passes the
full ONNX check (where the input does), leaves the input file alone, and runs in onnxruntime
(fp16: its CPU provider lacks most bf16 kernels) and in onnx.reference within 1e-2 (bf16:
3e-2) of the FP32 model under onnxruntime; or, where fp16 overflows, ``--validate`` names the
overflow (exit 4). What a peer's test asserts beyond that is kept (Resize's scales stay
float32, a custom op runs in float32).
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx.reference.op_run import OpRun

from amp_rewrite.cli import main
from amp_rewrite.onnx.validate import reference_evaluator

from ._helpers import ort_run, rel_error

T = onnx.TensorProto
TOLERANCE = {"fp16": 1e-2, "bf16": 3e-2}
CUSTOM_DOMAIN = "com.example.peer"


@dataclasses.dataclass
class PeerModel:
    model: onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]  # one dict per path to cover (both If branches, ...)
    # exit code per dtype where it is not 0 (4: --validate must name an overflow)
    exit_codes: dict[str, int] = dataclasses.field(default_factory=dict)
    # ops onnx.reference runs given these kernels (onnxruntime has none)
    reference_ops: tuple[type, ...] = ()
    check: Callable[[onnx.ModelProto], None] | None = None  # what the peer's test asserts


def model_of(nodes, inputs, outputs, inits=(), opset=18, domains=()) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "peer", inputs, outputs, list(inits))
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset),
                                                *(oh.make_opsetid(d, 1) for d in domains)])
    model.ir_version = 9
    return model


def tensor(name: str, shape, scale=0.3, seed=0) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return onh.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def vi(name: str, dtype=T.FLOAT, shape=None) -> onnx.ValueInfoProto:
    return oh.make_tensor_value_info(name, dtype, shape)


def normal(*shape, seed=1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ----------------------------------------------------------------------------- control flow


def if_reading_outer_values() -> PeerModel:
    """A branch reads values of the graph around it (h, w) and of its If's own graph."""
    then = oh.make_graph([oh.make_node("MatMul", ["h", "w"], ["t"]),
                          oh.make_node("Add", ["t", "x"], ["o1"])], "then", [],
                         [vi("o1", shape=[2, 8])])
    other = oh.make_graph([oh.make_node("Sigmoid", ["h"], ["o2"])], "else", [],
                          [vi("o2", shape=[2, 8])])
    model = model_of([oh.make_node("MatMul", ["x", "w"], ["h"]),
                      oh.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                     [vi("x", shape=[2, 8]), vi("c", T.BOOL, [])], [vi("y", shape=[2, 8])],
                     [tensor("w", (8, 8))])
    return PeerModel(model, [{"x": normal(2, 8), "c": np.array(c)} for c in (True, False)])


def loop_reading_outer_values() -> PeerModel:
    """acc = tanh(acc @ w + bias) n times, w and bias read from the outer graph, with a
    scan output of every step."""
    body = oh.make_graph(
        [oh.make_node("MatMul", ["acc_in", "w"], ["mm"]),
         oh.make_node("Add", ["mm", "bias"], ["pre"]),
         oh.make_node("Tanh", ["pre"], ["acc_out"]),
         oh.make_node("Identity", ["acc_out"], ["step"]),
         oh.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [vi("i", T.INT64, []), vi("cond_in", T.BOOL, []), vi("acc_in", shape=[2, 8])],
        [vi("cond_out", T.BOOL, []), vi("acc_out", shape=[2, 8]), vi("step", shape=[2, 8])])
    model = model_of([oh.make_node("Relu", ["x"], ["bias"]),
                      oh.make_node("Loop", ["n", "keep_going", "x"], ["acc", "steps"],
                                   body=body)],
                     [vi("x", shape=[2, 8]), vi("n", T.INT64, [])],
                     [vi("acc", shape=[2, 8]), vi("steps", shape=[None, 2, 8])],
                     [tensor("w", (8, 8)), onh.from_array(np.array(True), "keep_going")])
    return PeerModel(model, [{"x": normal(2, 8), "n": np.array(n, np.int64)} for n in (3, 0)])


def nested_ifs() -> PeerModel:
    """An If inside an If's branch; the inner branch reads values two scopes out."""
    inner_then = oh.make_graph([oh.make_node("MatMul", ["h", "w"], ["i1"])], "inner_then", [],
                               [vi("i1", shape=[2, 8])])
    inner_else = oh.make_graph([oh.make_node("Mul", ["h", "x"], ["i2"])], "inner_else", [],
                               [vi("i2", shape=[2, 8])])
    outer_then = oh.make_graph(
        [oh.make_node("If", ["c2"], ["inner"], then_branch=inner_then, else_branch=inner_else),
         oh.make_node("Softmax", ["inner"], ["o1"], axis=-1)], "outer_then", [],
        [vi("o1", shape=[2, 8])])
    outer_else = oh.make_graph([oh.make_node("Relu", ["h"], ["o2"])], "outer_else", [],
                               [vi("o2", shape=[2, 8])])
    model = model_of([oh.make_node("MatMul", ["x", "w"], ["h"]),
                      oh.make_node("If", ["c1"], ["y"], then_branch=outer_then,
                                   else_branch=outer_else)],
                     [vi("x", shape=[2, 8]), vi("c1", T.BOOL, []), vi("c2", T.BOOL, [])],
                     [vi("y", shape=[2, 8])], [tensor("w", (8, 8))])
    feeds = [{"x": normal(2, 8), "c1": np.array(a), "c2": np.array(b)}
             for a, b in ((True, True), (True, False), (False, False))]
    return PeerModel(model, feeds)


def chained_ifs() -> PeerModel:
    """The output of one If is read by the next If's branches."""
    def branch(name: str, op: str, src: str) -> onnx.GraphProto:
        nodes = ([oh.make_node("MatMul", [src, "w"], [name])] if op == "MatMul"
                 else [oh.make_node(op, [src], [name])])
        return oh.make_graph(nodes, name, [], [vi(name, shape=[2, 8])])

    model = model_of([oh.make_node("If", ["c1"], ["y1"], then_branch=branch("a", "MatMul", "x"),
                                   else_branch=branch("b", "Tanh", "x")),
                      oh.make_node("If", ["c2"], ["y2"],
                                   then_branch=branch("d", "MatMul", "y1"),
                                   else_branch=branch("e", "Sigmoid", "y1")),
                      oh.make_node("Add", ["y1", "y2"], ["y"])],
                     [vi("x", shape=[2, 8]), vi("c1", T.BOOL, []), vi("c2", T.BOOL, [])],
                     [vi("y", shape=[2, 8])], [tensor("w", (8, 8))])
    feeds = [{"x": normal(2, 8), "c1": np.array(a), "c2": np.array(b)}
             for a in (True, False) for b in (True, False)]
    return PeerModel(model, feeds)


# ----------------------------------------------------------------------------- shapes


def empty_tensors() -> PeerModel:
    """A [0, 8] initializer concatenated to the input, and a [0, 8] output of a MatMul."""
    empty = onh.from_array(np.zeros((0, 8), np.float32), "empty")
    model = model_of([oh.make_node("Concat", ["x", "empty"], ["xc"], axis=0),
                      oh.make_node("MatMul", ["xc", "w"], ["y"]),
                      oh.make_node("MatMul", ["empty", "w"], ["nothing"]),
                      oh.make_node("Relu", ["nothing"], ["z"])],
                     [vi("x", shape=[2, 8])], [vi("y", shape=[2, 8]), vi("z", shape=[0, 8])],
                     [tensor("w", (8, 8)), empty])
    return PeerModel(model, [{"x": normal(2, 8)}])


def zero_batch() -> PeerModel:
    """A symbolic batch fed with 0 rows, and with 3."""
    model = model_of([oh.make_node("MatMul", ["x", "w"], ["h"]),
                      oh.make_node("Softmax", ["h"], ["y"], axis=-1)],
                     [vi("x", shape=["batch", 8])], [vi("y", shape=["batch", 8])],
                     [tensor("w", (8, 8))])
    return PeerModel(model, [{"x": normal(0, 8)}, {"x": normal(3, 8)}])


def symbolic_dims() -> PeerModel:
    """Batch and sequence symbolic; attention-like MatMul/Softmax and a LayerNorm."""
    model = model_of([oh.make_node("MatMul", ["x", "w"], ["q"]),
                      oh.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1]),
                      oh.make_node("MatMul", ["q", "qt"], ["s"]),
                      oh.make_node("Softmax", ["s"], ["p"], axis=-1),
                      oh.make_node("MatMul", ["p", "q"], ["o"]),
                      oh.make_node("LayerNormalization", ["o", "gamma"], ["y"], axis=-1)],
                     [vi("x", shape=["batch", "seq", 8])], [vi("y", shape=["batch", "seq", 8])],
                     [tensor("w", (8, 8)), onh.from_array(np.ones(8, np.float32), "gamma")])
    return PeerModel(model, [{"x": normal(1, 5, 8)}, {"x": normal(3, 2, 8)}])


def resize_scales_from_tensor() -> PeerModel:
    """Resize whose scales are computed (a Mul of two Constant nodes), as in the peers'
    tests: scales stay float32 (the op takes no other type)."""
    def constant(name: str, values) -> onnx.NodeProto:
        return oh.make_node("Constant", [], [name],
                            value=onh.from_array(np.array(values, np.float32), name))

    model = model_of([oh.make_node("Conv", ["x", "k"], ["c"], pads=[1, 1, 1, 1]),
                      constant("base_scales", [1, 1, 1, 1]), constant("factor", [1, 1, 2, 2]),
                      oh.make_node("Mul", ["base_scales", "factor"], ["scales"]),
                      oh.make_node("Resize", ["c", "", "scales"], ["r"], mode="linear"),
                      oh.make_node("Relu", ["r"], ["y"])],
                     [vi("x", shape=[1, 3, 4, 4])], [vi("y", shape=[1, 4, 8, 8])],
                     [tensor("k", (4, 3, 3, 3))])
    return PeerModel(model, [{"x": normal(1, 3, 4, 4)}], check=resize_inputs_keep_their_types)


def resize_sizes_from_tensor() -> PeerModel:
    """Resize whose sizes are computed from the input's shape (Shape, Slice, Mul, Concat)."""
    nodes = [oh.make_node("Conv", ["x", "k"], ["c"], pads=[1, 1, 1, 1]),
             oh.make_node("Shape", ["c"], ["shape"]),
             oh.make_node("Slice", ["shape", "zero", "two"], ["nc"]),
             oh.make_node("Slice", ["shape", "two", "four"], ["hw"]),
             oh.make_node("Mul", ["hw", "two_x"], ["hw2"]),
             oh.make_node("Concat", ["nc", "hw2"], ["sizes"], axis=0),
             oh.make_node("Resize", ["c", "", "", "sizes"], ["r"], mode="nearest"),
             oh.make_node("Sigmoid", ["r"], ["y"])]
    ints = {"zero": [0], "two": [2], "four": [4], "two_x": [2, 2]}
    model = model_of(nodes, [vi("x", shape=[1, 3, 4, 4])], [vi("y", shape=[1, 4, 8, 8])],
                     [tensor("k", (4, 3, 3, 3)),
                      *(onh.from_array(np.array(v, np.int64), n) for n, v in ints.items())])
    return PeerModel(model, [{"x": normal(1, 3, 4, 4)}], check=resize_inputs_keep_their_types)


def resize_inputs_keep_their_types(mixed: onnx.ModelProto) -> None:
    types = value_types(mixed)
    for node in mixed.graph.node:
        if node.op_type != "Resize":
            continue
        wanted = {2: T.FLOAT, 3: T.INT64}  # roi, scales, sizes by position
        for position, dtype in wanted.items():
            if position < len(node.input) and node.input[position]:
                assert types[node.input[position]] == dtype, (node.input[position], types)


# ----------------------------------------------------------------------------- casts and I/O


def cast_input_to_output() -> PeerModel:
    """A graph input cast straight to a graph output (to float32, and to float16), beside an
    output that is computed; and an input that is itself a graph output."""
    model = model_of([oh.make_node("Cast", ["x"], ["x_f32"], to=T.FLOAT),
                      oh.make_node("Cast", ["x"], ["x_f16"], to=T.FLOAT16),
                      oh.make_node("MatMul", ["x", "w"], ["y"])],
                     [vi("x", shape=[2, 8])],
                     [vi("x_f32", shape=[2, 8]), vi("x_f16", T.FLOAT16, [2, 8]),
                      vi("y", shape=[2, 8]), vi("x", shape=[2, 8])],
                     [tensor("w", (8, 8))])
    return PeerModel(model, [{"x": normal(2, 8)}], check=outputs_keep_their_types(model))


def inputs_cast_to_outputs() -> PeerModel:
    """One Cast of an input read by two graph outputs' producers and by the compute, as
    exporters write an input cast: Cast(x) -> output, Cast(x) -> MatMul -> output."""
    model = model_of([oh.make_node("Cast", ["ids"], ["ids_f"], to=T.FLOAT),
                      oh.make_node("Identity", ["ids_f"], ["ids_out"]),
                      oh.make_node("MatMul", ["ids_f", "w"], ["h"]),
                      oh.make_node("Add", ["h", "x"], ["y"])],
                     [vi("ids", T.INT64, [2, 8]), vi("x", shape=[2, 8])],
                     [vi("ids_out", shape=[2, 8]), vi("y", shape=[2, 8])],
                     [tensor("w", (8, 8), scale=0.05)])
    feeds = [{"ids": np.arange(16, dtype=np.int64).reshape(2, 8) % 5, "x": normal(2, 8)}]
    return PeerModel(model, feeds, check=outputs_keep_their_types(model))


def outputs_keep_their_types(fp32: onnx.ModelProto) -> Callable[[onnx.ModelProto], None]:
    declared = {o.name: o.type.tensor_type.elem_type for o in fp32.graph.output}

    def check(mixed: onnx.ModelProto) -> None:
        assert {o.name: o.type.tensor_type.elem_type for o in mixed.graph.output} == declared
    return check


class PeerCustomOp(OpRun):
    """The custom op: y = x * sigmoid(x), computed in float32 whatever it is given."""

    op_domain = CUSTOM_DOMAIN

    def _run(self, x):
        assert x.dtype == np.float32, x.dtype  # the rewrite keeps it float32
        return ((x / (1 + np.exp(-x))).astype(np.float32),)


def custom_domain_op() -> PeerModel:
    """An op of a domain no runtime knows between two GEMMs: onnxruntime refuses to load the
    model (no kernel) but a runtime with the op registered runs it, so the rewrite keeps it
    float32 and lowers the rest."""
    model = model_of([oh.make_node("MatMul", ["x", "w"], ["h"]),
                      oh.make_node("PeerCustomOp", ["h"], ["a"], domain=CUSTOM_DOMAIN),
                      oh.make_node("MatMul", ["a", "w"], ["y"])],
                     [vi("x", shape=[2, 8])], [vi("y", shape=[2, 8])], [tensor("w", (8, 8))],
                     domains=[CUSTOM_DOMAIN])
    return PeerModel(model, [{"x": normal(2, 8)}], reference_ops=(PeerCustomOp,),
                     check=custom_op_stays_fp32)


def custom_op_stays_fp32(mixed: onnx.ModelProto) -> None:
    """Its input is float32 (PeerCustomOp checks that again as it runs); its output has no
    inferred type, so its readers take it as the op gives it."""
    types = value_types(mixed)
    (node,) = [n for n in mixed.graph.node if n.domain == CUSTOM_DOMAIN]
    assert types[node.input[0]] == T.FLOAT
    readers = [n for n in mixed.graph.node if node.output[0] in n.input]
    assert readers and all(n.op_type != "Cast" for n in readers)


# ----------------------------------------------------------------------------- values, names


def constants_beyond_fp16() -> PeerModel:
    """Constants beyond fp16's 65504: a -1e6 mask fill before a Softmax, and a weight of
    ~1e5 whose product is scaled back by 1e-5."""
    model = model_of([oh.make_node("MatMul", ["x", "w"], ["h"]),
                      oh.make_node("Less", ["x", "zero"], ["mask"]),
                      oh.make_node("Where", ["mask", "neg_big", "h"], ["masked"]),
                      oh.make_node("Softmax", ["masked"], ["p"], axis=-1),
                      oh.make_node("MatMul", ["p", "w_big"], ["big"]),
                      oh.make_node("Mul", ["big", "tiny"], ["y"])],
                     [vi("x", shape=[2, 8])], [vi("p", shape=[2, 8]), vi("y", shape=[2, 8])],
                     [tensor("w", (8, 8)), tensor("w_big", (8, 8), scale=1e5),
                      onh.from_array(np.float32(-1e6), "neg_big"),
                      onh.from_array(np.float32(0), "zero"),
                      onh.from_array(np.float32(1e-5), "tiny")])
    return PeerModel(model, [{"x": normal(2, 8)}])


def activations_beyond_fp16() -> PeerModel:
    """Constants in range whose product is not: (x @ w * 300)^2 reaches ~1e5 > 65504 in
    fp16; bf16 holds it."""
    model = model_of([oh.make_node("MatMul", ["x", "w"], ["h"]),
                      oh.make_node("Mul", ["h", "gain"], ["g"]),
                      oh.make_node("Mul", ["g", "g"], ["y"])],
                     [vi("x", shape=[2, 8])], [vi("y", shape=[2, 8])],
                     [tensor("w", (8, 8), scale=1.0), onh.from_array(np.float32(300), "gain")])
    return PeerModel(model, [{"x": normal(2, 8)}], exit_codes={"fp16": 4})


def constants_below_fp16() -> PeerModel:
    """A weight of ~1e-9, below fp16's smallest subnormal (6e-8), scaled back by 1e9: stored
    in fp16 it would be all zeros."""
    model = model_of([oh.make_node("MatMul", ["x", "w_tiny"], ["h"]),
                      oh.make_node("Mul", ["h", "huge"], ["y"])],
                     [vi("x", shape=[2, 8])], [vi("y", shape=[2, 8])],
                     [tensor("w_tiny", (8, 8), scale=1e-9),
                      onh.from_array(np.float32(1e9), "huge")])
    return PeerModel(model, [{"x": normal(2, 8)}])


def already_mixed() -> PeerModel:
    """A model that already computes in fp16 between its own casts, beside fp32 compute."""
    w16 = onh.from_array((normal(8, 8, seed=3) * 0.3).astype(np.float16), "w16")
    model = model_of([oh.make_node("Cast", ["x"], ["x16"], to=T.FLOAT16),
                      oh.make_node("MatMul", ["x16", "w16"], ["h16"]),
                      oh.make_node("Cast", ["h16"], ["h"], to=T.FLOAT),
                      oh.make_node("MatMul", ["h", "w"], ["g"]),
                      oh.make_node("Softmax", ["g"], ["y"], axis=-1)],
                     [vi("x", shape=[2, 8])], [vi("y", shape=[2, 8])],
                     [tensor("w", (8, 8)), w16])
    return PeerModel(model, [{"x": normal(2, 8)}], check=own_casts_kept)


def own_casts_kept(mixed: onnx.ModelProto) -> None:
    """The model's own fp16 region survives (its author's choice): its Cast to fp16 and its
    fp16 weight. (Its Cast back to fp32 may go: the next MatMul now runs low.)"""
    casts = {n.output[0]: n.attribute[0].i for n in mixed.graph.node if n.op_type == "Cast"}
    assert casts["x16"] == T.FLOAT16
    assert {t.name: t.data_type for t in mixed.graph.initializer}["w16"] == T.FLOAT16


def clip_and_multi_output_ops() -> PeerModel:
    """Clip with min and max inputs, Split and TopK (several outputs, one of them int64),
    reading the same weight twice."""
    model = model_of([oh.make_node("MatMul", ["x", "w"], ["h"]),
                      oh.make_node("Clip", ["h", "lo", "hi"], ["c"]),
                      oh.make_node("Split", ["c"], ["a", "b"], axis=1, num_outputs=2),
                      oh.make_node("TopK", ["a", "k"], ["values", "indices"], axis=1),
                      oh.make_node("MatMul", ["c", "w"], ["g"]),
                      oh.make_node("Add", ["g", "b_wide"], ["y"])],
                     [vi("x", shape=[2, 8])],
                     [vi("values", shape=[2, 2]), vi("indices", T.INT64, [2, 2]),
                      vi("b", shape=[2, 4]), vi("y", shape=[2, 8])],
                     [tensor("w", (8, 8)), tensor("b_wide", (8,)),
                      onh.from_array(np.float32(-0.5), "lo"), onh.from_array(np.float32(0.5), "hi"),
                      onh.from_array(np.array([2], np.int64), "k")])
    return PeerModel(model, [{"x": normal(2, 8)}])


def duplicate_node_names() -> PeerModel:
    """Every node named "node", and some unnamed."""
    model = model_of([oh.make_node("MatMul", ["x", "w"], ["h"], name="node"),
                      oh.make_node("Relu", ["h"], ["r"], name="node"),
                      oh.make_node("MatMul", ["r", "w"], ["h2"], name="node"),
                      oh.make_node("Add", ["h2", "x"], ["s"]),
                      oh.make_node("Softmax", ["s"], ["y"], name="node", axis=-1)],
                     [vi("x", shape=[2, 8])], [vi("y", shape=[2, 8])], [tensor("w", (8, 8))])
    return PeerModel(model, [{"x": normal(2, 8)}])


def untyped_outputs() -> PeerModel:
    """Graph outputs declared by name only (no type), of plain nodes and of an If."""
    then = oh.make_graph([oh.make_node("MatMul", ["h", "w"], ["o1"])], "then", [],
                         [onnx.ValueInfoProto(name="o1")])
    other = oh.make_graph([oh.make_node("Relu", ["h"], ["o2"])], "else", [],
                          [onnx.ValueInfoProto(name="o2")])
    model = model_of([oh.make_node("MatMul", ["x", "w"], ["h"]),
                      oh.make_node("Tanh", ["h"], ["t"]),
                      oh.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                     [vi("x", shape=[2, 8]), vi("c", T.BOOL, [])],
                     [onnx.ValueInfoProto(name="t"), onnx.ValueInfoProto(name="y")],
                     [tensor("w", (8, 8))])
    return PeerModel(model, [{"x": normal(2, 8), "c": np.array(c)} for c in (True, False)])


MODELS: dict[str, Callable[[], PeerModel]] = {f.__name__: f for f in (
    if_reading_outer_values, loop_reading_outer_values, nested_ifs, chained_ifs,
    empty_tensors, zero_batch, symbolic_dims, resize_scales_from_tensor,
    resize_sizes_from_tensor, cast_input_to_output, inputs_cast_to_outputs, custom_domain_op,
    constants_beyond_fp16, constants_below_fp16, activations_beyond_fp16, already_mixed,
    clip_and_multi_output_ops, duplicate_node_names, untyped_outputs)}


# ----------------------------------------------------------------------------- the checks


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every value of the main graph (after type inference)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.output, *g.value_info)}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def passes_full_check(model: onnx.ModelProto) -> bool:
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError:
        return False
    return True


def reference_run(model: onnx.ModelProto, feeds: dict, custom_ops=()) -> list[np.ndarray]:
    return reference_evaluator(model, tuple(custom_ops)).run(None, feeds)


def convert(tmp_path, capsys, model: onnx.ModelProto, dtype: str, *flags) -> tuple[int, str]:
    src, out = tmp_path / "peer.onnx", tmp_path / "peer.amp.onnx"
    onnx.save(model, src)
    before = hashlib.sha256(src.read_bytes()).hexdigest()
    code = main([str(src), "-o", str(out), "--dtype", dtype, "-q", *flags])
    err = capsys.readouterr().err
    assert hashlib.sha256(src.read_bytes()).hexdigest() == before
    assert "Traceback" not in err
    return code, err


def onnxruntime_refusal(model: onnx.ModelProto) -> str | None:
    """onnxruntime's reason for not loading the model, or None where it loads it."""
    import onnxruntime as ort

    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime's errors share no base class
        return str(e)
    return None


def fp32_outputs(peer: PeerModel, feeds: dict, ort_loads: bool) -> list[np.ndarray]:
    if ort_loads:
        return ort_run(peer.model, feeds)
    return reference_run(peer.model, feeds, peer.reference_ops)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_peer_suite_model_converts_and_stays_close(tmp_path, capsys, name, dtype):
    peer = MODELS[name]()
    ort_loads = onnxruntime_refusal(peer.model) is None
    code, err = convert(tmp_path, capsys, peer.model, dtype, "--validate")
    if not ort_loads:  # --validate cannot run it: refused, naming onnxruntime's reason
        assert code == 3 and err.count("\n") == 1, err
        assert "onnxruntime cannot load the model" in err
        code, err = convert(tmp_path, capsys, peer.model, dtype)
    expected_code = peer.exit_codes.get(dtype, 0)
    assert code == expected_code, err
    if expected_code == 4:
        assert "overflow" in err and err.count("\n") == 1, err
        return
    mixed = onnx.load(tmp_path / "peer.amp.onnx")
    if passes_full_check(peer.model):
        onnx.checker.check_model(mixed, full_check=True)
    if peer.check is not None:
        peer.check(mixed)
    for feeds in peer.feeds:
        expected = fp32_outputs(peer, feeds, ort_loads)
        runs = [reference_run(mixed, feeds, peer.reference_ops)]
        if dtype == "fp16" and ort_loads:
            runs.append(ort_run(mixed, feeds))
        for got in runs:
            for e, g in zip(expected, got, strict=True):
                assert g.dtype == e.dtype and g.shape == e.shape
                if e.size:
                    assert rel_error(e, g) <= TOLERANCE[dtype], (feeds, e, g)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_loop_of_zero_steps_validates(tmp_path, capsys, dtype):
    """--validate on inputs that run the Loop zero times: its scan output has no rows, and
    onnx.reference (bf16) gives it the shape onnxruntime gives (an internal error before)."""
    peer = loop_reading_outer_values()
    data = tmp_path / "zero_steps.npz"
    np.savez(data, x=normal(2, 8), n=np.array(0, np.int64))
    code, err = convert(tmp_path, capsys, peer.model, dtype, "--validate", f"--calibrate={data}")
    assert code == 0, err


@pytest.mark.parametrize("name, reason", [("custom_domain_op", CUSTOM_DOMAIN),
                                          ("duplicate_node_names", "same node name")])
def test_onnxruntime_refuses_these_inputs(name, reason):
    """Why these models' oracle is onnx.reference, and --validate is refused on them."""
    assert reason in onnxruntime_refusal(MODELS[name]().model)
