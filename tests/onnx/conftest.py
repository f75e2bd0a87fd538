from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "transformer_block.onnx"
EXAMPLE_INPUTS = EXAMPLE.with_name("transformer_block_inputs.npz")

# A branch reads values of the outer graph (h, w): the case for capture handling.
IF_CAPTURES_OUTER = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 8] x, bool c) => (float[2, 8] y) <float[8, 8] w> {
    h = MatMul(x, w)
    y = If(c) <
      then_branch = t () => (float[2, 8] o1) { o1 = MatMul(h, w) },
      else_branch = e () => (float[2, 8] o2) { o2 = Relu(h) }
    >
}
"""


def parse(text: str) -> onnx.ModelProto:
    """Parse ONNX text; graph-level declarations without values become zero initializers."""
    model = onnx.parser.parse_model(text)
    produced = {o for n in model.graph.node for o in n.output}
    for vi in list(model.graph.value_info):
        if vi.name in produced:
            continue
        t = vi.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        shape = [d.dim_value for d in t.shape.dim]
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(shape, dtype), vi.name))
        model.graph.value_info.remove(vi)
    onnx.checker.check_model(model, full_check=True)
    return model


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def cast_targets(model: onnx.ModelProto) -> list[int]:
    return [n.attribute[0].i for n in model.graph.node if n.op_type == "Cast"]


def run_reference(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def ext_model(tmp_path):
    """The example block with its weights in ``a.onnx.data``."""
    path = tmp_path / "a.onnx"
    onnx.save(onnx.load(EXAMPLE), path, save_as_external_data=True, location="a.onnx.data",
              size_threshold=0)
    return path
