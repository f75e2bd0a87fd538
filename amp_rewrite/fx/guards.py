"""What the rewrite checks or adapts before planning, so it never returns a silent wrong result.

* ``refuse_non_float_gemm_inputs``: an integer tensor into a GEMM or convolution (the ops of
  the allow class: torch.autocast's lower-precision list) fails when the module is called
  (``mat1 and mat2 must have the same dtype, Long and Half``), but capture does not notice: fake
  kernels do not check. Refused at rewrite time with a ``UsageError`` naming node and input.
* ``ConvertForeignFloats``: a model whose tensors are in the *other* low dtype (bfloat16 when
  the target is float16, or the reverse) is converted as ``torch.autocast`` converts it: every
  such input, parameter and buffer gets a ``_to_copy(dtype=float32)`` that the plan then
  retypes to the target dtype where its readers run low, so lower-precision ops run in the
  target dtype and fp32 ops in fp32 (autocast upcasts the low inputs of its fp32 list). Graph
  outputs are converted back to their original dtype (``keep_io_types``). float64 tensors are left alone, as
  autocast leaves them: a float64 model comes back unchanged, with a note that says so.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from amp_rewrite.core import OpClass, RuleSet
from amp_rewrite.errors import UsageError
from amp_rewrite.fx import opkeys
from amp_rewrite.fx.capture import refresh_fake_values
from amp_rewrite.fx.view import is_cast, tensor_args

FOREIGN_TAG = "amp_rewrite_foreign_float"  # node.meta key on the conversions this pass adds
_OTHER_LOW = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16}
_TO_COPY = torch.ops.aten._to_copy.default


def _dtype(node: Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _is_integer(dtype: torch.dtype | None) -> bool:
    return dtype is not None and not (dtype.is_floating_point or dtype.is_complex
                                      or dtype == torch.bool)


def refuse_non_float_gemm_inputs(gm: torch.fx.GraphModule, rules: RuleSet) -> None:
    """UsageError for the first allow-class op that reads an integer tensor."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        key = opkeys.op_key(node, gm)
        if rules.class_of(key) is not OpClass.ALLOW:
            continue
        for _, arg in tensor_args(node):
            if _is_integer(_dtype(arg)):
                raise UsageError(
                    f"node {node.name} ({key}{_module_path(node)}) reads {arg.name} as "
                    f"{_dtype(arg)}: {key} needs floating-point inputs, and the module would "
                    f"fail when called; convert it first (e.g. {arg.name}.float())")


def _module_path(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return f" in module {next(reversed(stack.values()))[0]}" if stack else ""


class ConvertForeignFloats(PassBase):
    """Inputs, parameters and buffers in the other low dtype → fp32 conversions the plan
    retypes; outputs back to their dtype (module docstring). ``notes`` says what it did."""

    def __init__(self, low: torch.dtype, keep_io_types: bool = True) -> None:
        self.low = low
        self.keep_io_types = keep_io_types
        self.foreign = _OTHER_LOW[low]
        self.notes: list[str] = []

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        sources = self._foreign_sources(graph_module)
        outputs = self._foreign_outputs(graph_module) if self.keep_io_types else []
        for node in sources:
            self._convert_reads(graph_module.graph, node, torch.float32)
        for output, path_index in outputs:
            self._convert_output(graph_module.graph, output, path_index)
        changed = bool(sources or outputs)
        if changed:
            graph_module.graph.lint()
            graph_module.recompile()
            refresh_fake_values(graph_module)
        self.notes = self._describe(graph_module, sources)
        return PassResult(graph_module, changed)

    def _foreign_sources(self, gm: torch.fx.GraphModule) -> list[Node]:
        written = _written_sources(gm)
        return [n for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")
                and _dtype(n) == self.foreign and n not in written
                and any(not u.meta.get(FOREIGN_TAG) and not _is_input_guard(u)
                        for u in n.users)]

    def _foreign_outputs(self, gm: torch.fx.GraphModule) -> list[tuple[Node, int]]:
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        found = []
        for i, (_, arg) in enumerate(tensor_args(output)):
            if _dtype(arg) == self.foreign and not arg.meta.get(FOREIGN_TAG) \
                    and arg.op != "placeholder":
                found.append((output, i))
        return found

    @staticmethod
    def _convert_reads(graph: torch.fx.Graph, node: Node, dtype: torch.dtype) -> None:
        anchor = node
        if node.op == "placeholder":  # keep placeholders together at the top
            anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(anchor):
            conversion = graph.call_function(_TO_COPY, (node,), {"dtype": dtype})
        conversion.meta[FOREIGN_TAG] = True
        conversion.meta["val"] = node.meta["val"].to(dtype)
        node.replace_all_uses_with(conversion, delete_user_cb=lambda user: user is not conversion
                                   and not _is_input_guard(user))

    def _convert_output(self, graph: torch.fx.Graph, output: Node, index: int) -> None:
        args = list(tensor_args(output))
        path, value = args[index]
        with graph.inserting_before(output):
            conversion = graph.call_function(_TO_COPY, (value,), {"dtype": self.foreign})
        conversion.meta[FOREIGN_TAG] = True
        conversion.meta["val"] = value.meta["val"].to(self.foreign)
        from amp_rewrite.fx.apply import set_arg  # apply imports view; no cycle at call time
        set_arg(output, path, conversion)

    def _describe(self, gm: torch.fx.GraphModule, converted: list[Node]) -> list[str]:
        dtypes = {_dtype(n) for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")
                  and not is_cast(n)} - {None}
        floats = {d for d in dtypes if d.is_floating_point}
        notes = []
        if converted or any(n.meta.get(FOREIGN_TAG) for n in gm.graph.nodes):
            notes.append(f"the model's {self.foreign} tensors are converted as "
                         f"torch.autocast(dtype={self.low}) converts them: to {self.low} for "
                         "ops that run low, to float32 for ops that need it"
                         + (f"; outputs keep {self.foreign}" if self.keep_io_types else ""))
        if torch.float64 in floats:
            notes.append("float64 tensors are left as they are (torch.autocast never casts "
                         "float64)" + ("; the model has no float32 or low-precision tensor, "
                                       "so it is returned unchanged: convert it to float32 "
                                       "first to rewrite it" if floats == {torch.float64}
                                       else ""))
        return notes


def _is_input_guard(node: Node) -> bool:
    """export's ``_guards_fn`` checks the caller's inputs as given, before any conversion."""
    return node.op == "call_module" and node.target == "_guards_fn"


def _written_sources(gm: torch.fx.GraphModule) -> set[Node]:
    """Inputs, parameters and buffers some node writes in place (through views too)."""
    from amp_rewrite.fx.passes import storage_aliases  # passes imports this module's users

    written: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module") \
                and node.target is not operator.getitem:
            target = opkeys.mutated_argument(node, gm)
            if target is not None:
                written |= {a for a in storage_aliases(target, gm)
                            if a.op in ("placeholder", "get_attr")}
    return written
