"""Per-op rounding emulation: a plan's low ops measured in one onnxruntime session.

One instrumented copy of a prepared FP32 model serves every plan. Each port group of the
main graph (and each graph input and output the plan may make low) gets a boolean graph
input per low dtype the plans may give it, its flags; every float input and output of the
group goes through ``Where(flag, Cast(Cast(x, low), float), x)``. A mixed plan
(``--dtype mixed``: fp16 or bf16 per group) chains the two dtypes,
``Where(fp16_flag, round16(x), Where(bf16_flag, round_bf16(x), x))``, and sets at most one
flag of a group: the dtype ``plan.label`` gives it. With a plan's labels as the flags, the
copy computes each op in float32 on inputs rounded to its dtype and rounds its outputs once:
what a GPU kernel with fp32 accumulation does (tested against ``onnx.reference`` in
tests/onnx/test_budget.py and tests/onnx/test_mixed_budget.py). Casts need no emulation: a
value read in another dtype is the rounded value (an fp16 output read by a bf16 node is
rounded to fp16, then to bf16, as the fp16->bf16 Cast does). Flags all off give the FP32
reference. A plan costs one session run, not a rewrite. Subgraph bodies (If/Loop/Scan) are
not instrumented: they run in FP32.

The accuracy budget (``onnx/budget.py``) measures its plans here. ``validate.py`` checks a
rewritten model instead, which it runs in ``onnx.reference`` in the model's own dtypes.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir

from amp_rewrite.core.metric import worst_relative_error
from amp_rewrite.core.precision import Label

_FLAG_PREFIX = "amp_rewrite.budget_flag."
_LOW_ONNX = {Label.FP16: ir.DataType.FLOAT16, Label.BF16: ir.DataType.BFLOAT16}


class Emulator:
    """The instrumented model of a prepared pass (module docstring) and its session."""

    def __init__(self, pass_, model: ir.Model) -> None:
        self.pass_ = pass_
        self.view = pass_.view
        self.low = self.view.low.label  # a plan's low dtype where it has one
        self.labels = emulated_labels(pass_)
        self.flags: dict = {}  # group key -> {low dtype: flag input name}
        self.visible: dict[str, str] = {}  # value name -> the name its readers see
        self.outputs = [v.name for v in model.graph.outputs]
        # before instrumenting: the names the model gives each node's inputs and outputs
        self.node_io = {node.name: ([v.name if v is not None else "" for v in node.inputs],
                                    [v.name for v in node.outputs], node.op_type)
                        for node, _ in self.view.groups.values()}
        self._instrument(model)
        self.session = _session(ir.to_proto(model))
        self.fetchable = [o.name for o in self.session.get_outputs()]

    def _instrument(self, model: ir.Model) -> None:
        graph = model.graph
        rounded: dict[ir.Value, ir.Value] = {}
        flags: dict = {}
        self._instrument_inputs(graph, rounded)
        # outputs first: readers of a rounded output then see the Where, not the raw value
        for key, (node, pg) in self.view.groups.items():
            if node.graph is not graph:
                continue
            flags[key] = flag = self._flag(graph, key)
            for j in pg.outputs:
                out = node.outputs[j]
                if out.dtype == ir.DataType.FLOAT and out.name not in self.visible:
                    self._round_output(graph, node, out, flag, rounded)
        for key, (node, pg) in self.view.groups.items():
            flag = flags.get(key)
            if flag is None:
                continue
            for i in pg.inputs:
                v = node.inputs[i]
                if v is None or v.dtype != ir.DataType.FLOAT:
                    continue
                chosen = self._chosen(graph, flag, v, rounded, f"{v.name}.read{i}.{node.name}")
                node.replace_input_with(i, chosen)
        self._instrument_outputs(graph, rounded)
        graph.sort()
        existing = set(self.outputs)
        for node in list(graph):
            for v in node.outputs:
                if v.dtype == ir.DataType.FLOAT and v.name and v.name not in existing:
                    graph.outputs.append(v)
                    existing.add(v.name)

    def _instrument_inputs(self, graph, rounded) -> None:
        """Graph inputs the plan may make low (``keep_io_types=False``, ``low_io``): a flag
        each, the input rounded for every reader (before any reader is instrumented)."""
        inputs = set(graph.inputs)
        for key, (g, v, node) in self.view.sources.items():
            if g is not graph or node is not None or v.dtype != ir.DataType.FLOAT \
                    or v not in inputs:
                continue
            flag = self._flag(graph, key)
            uses = list(v.uses())
            chosen = self._chosen(graph, flag, v, rounded, f"{v.name}.input_rounded")
            for use in uses:
                use.node.replace_input_with(use.idx, chosen)

    def _instrument_outputs(self, graph, rounded) -> None:
        """Graph outputs the plan may make low: a flag each, the output rounded."""
        for key, (g, index) in self.view.sinks.items():
            out = g.outputs[index]
            if g is not graph or out.dtype != ir.DataType.FLOAT:
                continue
            flag = self._flag(graph, key)
            chosen = self._chosen(graph, flag, out, rounded, f"{out.name}.output_rounded")
            name = out.name
            out.name, chosen.name = f"{name}.unrounded_output", name
            graph.outputs[index] = chosen
            self.visible[name] = name

    def _flag(self, graph, key) -> dict[Label, ir.Value]:
        """One boolean graph input per emulated low dtype of group ``key``."""
        n = len(self.flags)
        flags = {}
        for label in self.labels:
            suffix = "" if len(self.labels) == 1 else f".{label.value}"
            flags[label] = ir.Value(name=f"{_FLAG_PREFIX}{n}{suffix}",
                                    type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
            graph.inputs.append(flags[label])
        self.flags[key] = {label: flag.name for label, flag in flags.items()}
        return flags

    def _round_output(self, graph, node, out: ir.Value, flag, rounded) -> None:
        uses = list(out.uses())
        was_output = out.is_graph_output()
        chosen = self._chosen(graph, flag, out, rounded, f"{out.name}.rounded")
        for use in uses:
            use.node.replace_input_with(use.idx, chosen)
        if was_output:
            index = next(k for k, v in enumerate(graph.outputs) if v is out)
            name = out.name
            out.name, chosen.name = f"{name}.unrounded", name
            graph.outputs[index] = chosen
            self.visible[name] = name
        else:
            self.visible[out.name] = chosen.name

    def _chosen(self, graph, flags: dict[Label, ir.Value], v: ir.Value, rounded: dict,
                name: str) -> ir.Value:
        """``v`` rounded to the dtype whose flag is set, else ``v``: one ``Where`` per
        emulated dtype, the first dtype outermost (it keeps ``name``)."""
        chosen = v
        for i, label in reversed(list(enumerate(self.labels))):
            inner = name if i == 0 else f"{name}.unless_{label.value}"
            chosen = self._where(graph, flags[label], self._rounded(graph, v, rounded, label),
                                 chosen, inner)
        return chosen

    def _rounded(self, graph, v: ir.Value, rounded: dict, label: Label) -> ir.Value:
        if (v, label) not in rounded:
            down = ir.node("Cast", [v], {"to": _LOW_ONNX[label]})
            up = ir.node("Cast", [down.outputs[0]], {"to": ir.DataType.FLOAT})
            n = len(rounded)  # unique: a renamed graph output may reuse a value's name
            down.outputs[0].name = f"{v.name}.low{n}"
            up.outputs[0].name = f"{v.name}.round{n}"
            up.outputs[0].dtype = ir.DataType.FLOAT
            graph.extend([down, up])
            rounded[v, label] = up.outputs[0]
        return rounded[v, label]

    def _where(self, graph, flag, a, b, name: str) -> ir.Value:
        node = ir.node("Where", [flag, a, b])
        node.outputs[0].name = name
        node.outputs[0].dtype = ir.DataType.FLOAT
        graph.append(node)
        return node.outputs[0]

    def run(self, feeds: Mapping[str, np.ndarray], plan, fetch: list[str] | None = None
            ) -> list[np.ndarray]:
        """Outputs (or ``fetch``) under ``plan`` (None: all FP32)."""
        return self.session.run(fetch or self.outputs, {**feeds, **self.flag_feeds(plan)})

    def flag_feeds(self, plan) -> dict[str, np.ndarray]:
        """Each flag set where ``plan`` runs its group in the flag's dtype (None: none)."""
        feeds = {}
        for key, flags in self.flags.items():
            label = None if plan is None else plan.label(key, self.low)
            feeds.update({name: np.array(label is own) for own, name in flags.items()})
        return feeds

    def error(self, feeds, reference: list[np.ndarray], plan) -> float:
        """The metric (``core.metric``) of the outputs under ``plan`` against ``reference``."""
        return worst_relative_error(reference, self.run(feeds, plan))


def emulated_labels(pass_) -> tuple[Label, ...]:
    """The low dtypes a pass's plans give groups: fp16 and bf16 for a mixed plan
    (``OnnxOptions.mixed``; fp16 alone below the opset whose Cast writes bf16, where no plan
    gives bf16 and the instrumented copy could not round to it), else the view's low dtype."""
    from amp_rewrite.onnx.mixed import bf16_casts_admitted

    if pass_.options.mixed:
        if bf16_casts_admitted(pass_.view.opsets):
            return (Label.FP16, Label.BF16)
        return (Label.FP16,)
    return (pass_.view.low.label,)


def _session(proto: onnx.ModelProto):
    import onnxruntime as ort

    from amp_rewrite.onnx.versions import loadable

    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    # no graph optimisation: it may fold a float -> low -> float Cast pair, the rounding itself
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(loadable(proto).SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
