"""An If-heavy voice-activity-detection model, shaped like Silero VAD.

Silero VAD (a real trained model shipped in pip packages) wraps its whole network in If
subgraphs: the top-level If picks the 16 kHz or the 8 kHz network, and each branch holds
further Ifs. Every branch reads the outer graph's audio, LSTM state and weights. This builder
makes a model of that shape with seeded random weights: STFT-like Conv, magnitude, Conv
encoder, an inner If, LSTM decoder, Conv + Sigmoid head; outputs the speech probability and
the new LSTM state. No download; about 60 nodes.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h

SAMPLES, HIDDEN, BINS = 512, 64, 32


def _weights(rng: np.random.Generator, tag: str) -> list[onnx.TensorProto]:
    def w(name, *shape, scale=None):
        fan_in = int(np.prod(shape[1:])) or 1
        s = scale if scale is not None else 1 / np.sqrt(fan_in)
        return onnx.numpy_helper.from_array(
            (rng.standard_normal(shape) * s).astype(np.float32), f"{tag}_{name}")

    return [w("stft", 2 * BINS, 1, 64), w("enc1", HIDDEN, BINS, 3), w("enc1_b", HIDDEN, scale=0.1),
            w("enc2", HIDDEN, HIDDEN, 3), w("enc2_b", HIDDEN, scale=0.1),
            w("enc3", HIDDEN, HIDDEN, 3), w("mix", HIDDEN, HIDDEN, 1),
            w("lstm_w", 1, 4 * HIDDEN, HIDDEN), w("lstm_r", 1, 4 * HIDDEN, HIDDEN),
            w("lstm_b", 1, 8 * HIDDEN, scale=0.1), w("head", 1, HIDDEN, 1),
            w("head_b", 1, scale=0.1)]


def _inner_if(tag: str) -> list[onnx.NodeProto]:
    """Long inputs get a 1x1 mixing Conv, short ones only a Relu (Silero's inner Ifs branch
    on lengths and rates in the same way); both branches read the outer ``enc``."""
    then = h.make_graph([h.make_node("Conv", ["enc", f"{tag}_mix"], [f"{tag}_mixed"]),
                         h.make_node("Relu", [f"{tag}_mixed"], [f"{tag}_t"])], f"{tag}_long", [],
                        [h.make_tensor_value_info(f"{tag}_t", T.FLOAT, None)])
    other = h.make_graph([h.make_node("Relu", ["enc"], [f"{tag}_e"])], f"{tag}_short", [],
                         [h.make_tensor_value_info(f"{tag}_e", T.FLOAT, None)])
    return [h.make_node("Shape", ["enc"], ["enc_shape"], start=2, end=3),
            h.make_node("Greater", ["enc_shape", "four"], ["is_long1"]),
            h.make_node("Squeeze", ["is_long1"], ["is_long"]),
            h.make_node("If", ["is_long"], ["mixed"], then_branch=then, else_branch=other)]


INTS = {"zero": [0], "one": [1], "two": [2], "bins": [BINS], "bins2": [2 * BINS], "four": [4]}


def _branch(tag: str, stride: int) -> onnx.GraphProto:
    p = lambda n: f"{tag}_{n}"  # noqa: E731
    # Index constants live in the branch, as exporters write them (shape inference sees them).
    nodes = [*(h.make_node("Constant", [], [k], value=onnx.numpy_helper.from_array(
        np.array(v, np.int64), k)) for k, v in INTS.items()),
        h.make_node("Unsqueeze", ["input", "one"], ["x3"]),
        h.make_node("Conv", ["x3", p("stft")], ["spec"], strides=[stride]),
        h.make_node("Slice", ["spec", "zero", "bins", "one"], ["re"]),
        h.make_node("Slice", ["spec", "bins", "bins2", "one"], ["im"]),
        h.make_node("Mul", ["re", "re"], ["re2"]), h.make_node("Mul", ["im", "im"], ["im2"]),
        h.make_node("Add", ["re2", "im2"], ["power"]), h.make_node("Sqrt", ["power"], ["mag"]),
        h.make_node("Conv", ["mag", p("enc1"), p("enc1_b")], ["e1"], pads=[1, 1]),
        h.make_node("Relu", ["e1"], ["r1"]),
        h.make_node("Conv", ["r1", p("enc2"), p("enc2_b")], ["e2"], pads=[1, 1]),
        h.make_node("Relu", ["e2"], ["r2"]),
        h.make_node("Conv", ["r2", p("enc3")], ["e3"], pads=[1, 1], strides=[2]),
        h.make_node("Relu", ["e3"], ["enc"]),
        *_inner_if(tag),
        h.make_node("Transpose", ["mixed"], ["seq"], perm=[2, 0, 1]),
        h.make_node("Slice", ["state", "zero", "one", "zero"], ["h0"]),
        h.make_node("Slice", ["state", "one", "two", "zero"], ["c0"]),
        h.make_node("LSTM", ["seq", p("lstm_w"), p("lstm_r"), p("lstm_b"), "", "h0", "c0"],
                    ["y", "yh", "yc"], hidden_size=HIDDEN),
        h.make_node("Squeeze", ["y", "one"], ["y3"]),
        h.make_node("Transpose", ["y3"], ["dec"], perm=[1, 2, 0]),
        h.make_node("Relu", ["dec"], ["dec_r"]),
        h.make_node("Conv", ["dec_r", p("head"), p("head_b")], ["logit"]),
        h.make_node("Sigmoid", ["logit"], ["prob"]),
        h.make_node("ReduceMean", ["prob"], ["out"], axes=[2], keepdims=0),
        h.make_node("Concat", ["yh", "yc"], ["new_state"], axis=0),
    ]
    outs = [h.make_tensor_value_info(f"{tag}_out", T.FLOAT, None),
            h.make_tensor_value_info(f"{tag}_state", T.FLOAT, None)]
    nodes += [h.make_node("Identity", ["out"], [f"{tag}_out"]),
              h.make_node("Identity", ["new_state"], [f"{tag}_state"])]
    graph = h.make_graph(nodes, f"{tag}_net", [], outs)
    _rename_locals(graph, tag)
    return graph


def _rename_locals(graph: onnx.GraphProto, tag: str) -> None:
    """Values produced inside a branch get the branch's prefix (names are model-wide)."""
    produced = {o for n in graph.node for o in n.output} - {o.name for o in graph.output}
    rename = {v: f"{tag}__{v}" for v in produced}
    for n in graph.node:
        n.input[:] = [rename.get(i, i) for i in n.input]
        n.output[:] = [rename.get(o, o) for o in n.output]
        for a in n.attribute:
            if a.HasField("g"):
                for inner in a.g.node:
                    inner.input[:] = [rename.get(i, i) for i in inner.input]


def vad_like_model(seed: int = 0) -> onnx.ModelProto:
    """The model; inputs ``input`` [1, 512], ``sr`` (int64 scalar), ``state`` [2, 1, 64]."""
    rng = np.random.default_rng(seed)
    inits = [onnx.numpy_helper.from_array(np.array(16000, np.int64), "sr16k")]
    inits += _weights(rng, "w16k") + _weights(rng, "w8k")
    top = h.make_node("If", ["is16k"], ["output", "stateN"],
                      then_branch=_branch("w16k", 16), else_branch=_branch("w8k", 8))
    graph = h.make_graph(
        [h.make_node("Equal", ["sr", "sr16k"], ["is16k"]), top], "vad_like",
        [h.make_tensor_value_info("input", T.FLOAT, [1, SAMPLES]),
         h.make_tensor_value_info("sr", T.INT64, []),
         h.make_tensor_value_info("state", T.FLOAT, [2, 1, HIDDEN])],
        [h.make_tensor_value_info("output", T.FLOAT, [1, 1]),
         h.make_tensor_value_info("stateN", T.FLOAT, [2, 1, HIDDEN])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def vad_feeds(sr: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input": rng.standard_normal((1, SAMPLES)).astype(np.float32) * 0.3,
            "sr": np.array(sr, np.int64),
            "state": rng.standard_normal((2, 1, HIDDEN)).astype(np.float32) * 0.5}
