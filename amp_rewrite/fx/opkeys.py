"""What an fx node is, in the rule files' vocabulary: op keys, dtype arguments, aliasing.

ATen overloads map to their operator name without namespace and overload
(``aten.linear.default`` → ``linear``), in-place variants to their functional name
(``add_`` → ``add``), custom ops to ``namespace::name`` and higher-order ops to
``higher_order::name``. Modules, functions and methods of ``symbolic_trace`` graphs map onto the
same keys (``nn.Linear``, ``F.linear`` → ``linear``; ``x.softmax`` → ``softmax``).
"""
from __future__ import annotations

import functools
import operator
import re
from typing import Any

import torch
from torch import nn

_OPERATOR_KEYS = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.floordiv: "floor_divide", operator.matmul: "matmul", operator.neg: "neg",
    operator.pow: "pow", operator.mod: "remainder", operator.abs: "abs",
    operator.iadd: "add", operator.isub: "sub", operator.imul: "mul",
    operator.itruediv: "div", operator.eq: "eq", operator.ne: "ne", operator.lt: "lt",
    operator.le: "le", operator.gt: "gt", operator.ge: "ge",
}
# Python's in-place operators and their out-of-place forms.
INPLACE_OPERATORS = {operator.iadd: operator.add, operator.isub: operator.sub,
                     operator.imul: operator.mul, operator.itruediv: operator.truediv}

# ATen views that are other views under another name (``weight.T`` is ``numpy_T`` in a
# pre-dispatch graph: Falcon's linear layers): the key of the view they are.
_ATEN_VIEW_ALIASES = {"numpy_T": "permute", "mT": "transpose", "mH": "transpose",
                      "matrix_H": "transpose", "adjoint": "transpose", "swapdims": "swapaxes",
                      "moveaxis": "movedim"}

# torch-level functions whose name is not their ATen name.
_FUNCTION_ALIASES = {"cross_entropy": "cross_entropy_loss", "normalize": "norm",
                     "softmin": "softmax", "concatenate": "cat"}
_CONVERSION_METHODS = {"float": torch.float32, "half": torch.float16,
                       "bfloat16": torch.bfloat16, "double": torch.float64}
_INTERPOLATE_KEYS = {"nearest": "upsample_nearest{n}d", "nearest-exact":
                     "_upsample_nearest_exact{n}d", "linear": "upsample_linear1d",
                     "bilinear": "upsample_bilinear2d", "bicubic": "upsample_bicubic2d",
                     "trilinear": "upsample_trilinear3d", "area": "adaptive_avg_pool{n}d"}

_MODULE_KEYS: dict[type, str] = {
    nn.Linear: "linear", nn.Bilinear: "bilinear", nn.LayerNorm: "layer_norm",
    nn.GroupNorm: "group_norm", nn.RMSNorm: "rms_norm", nn.Embedding: "embedding",
    nn.ReLU: "relu", nn.ReLU6: "hardtanh", nn.Hardtanh: "hardtanh", nn.GELU: "gelu",
    nn.SiLU: "silu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.Softmax: "softmax",
    nn.LogSoftmax: "log_softmax", nn.Softmin: "softmax", nn.Softplus: "softplus",
    nn.LeakyReLU: "leaky_relu", nn.ELU: "elu", nn.SELU: "selu", nn.CELU: "celu",
    nn.Mish: "mish", nn.GLU: "glu", nn.Hardswish: "hardswish", nn.Hardsigmoid: "hardsigmoid",
    nn.PReLU: "prelu", nn.Threshold: "threshold", nn.Identity: "alias",
    nn.Flatten: "flatten", nn.Unflatten: "unflatten", nn.PixelShuffle: "pixel_shuffle",
    nn.PixelUnshuffle: "pixel_unshuffle", nn.Dropout: "dropout", nn.Dropout1d: "dropout",
    nn.Dropout2d: "dropout", nn.Dropout3d: "dropout", nn.AlphaDropout: "alpha_dropout",
    nn.CosineSimilarity: "cosine_similarity", nn.MSELoss: "mse_loss", nn.L1Loss: "l1_loss",
    nn.CrossEntropyLoss: "cross_entropy_loss", nn.NLLLoss: "nll_loss",
    nn.BCELoss: "binary_cross_entropy", nn.BCEWithLogitsLoss: "binary_cross_entropy_with_logits",
    nn.SmoothL1Loss: "smooth_l1_loss", nn.HuberLoss: "huber_loss", nn.KLDivLoss: "kl_div",
}
# Numbered families: Conv2d -> conv2d, BatchNorm1d -> batch_norm, ...
_MODULE_FAMILIES = [
    (re.compile(r"ConvTranspose(\d)d"), "conv_transpose{n}d"), (re.compile(r"Conv(\d)d"), "conv{n}d"),
    (re.compile(r"(?:Lazy)?BatchNorm(\d)d"), "batch_norm"),
    (re.compile(r"InstanceNorm(\d)d"), "instance_norm"),
    (re.compile(r"MaxPool(\d)d"), "max_pool{n}d"), (re.compile(r"AvgPool(\d)d"), "avg_pool{n}d"),
    (re.compile(r"AdaptiveAvgPool(\d)d"), "adaptive_avg_pool{n}d"),
    (re.compile(r"AdaptiveMaxPool(\d)d"), "adaptive_max_pool{n}d"),
    (re.compile(r"ReflectionPad(\d)d"), "reflection_pad{n}d"),
    (re.compile(r"ReplicationPad(\d)d"), "replication_pad{n}d"),
    (re.compile(r"(?:Constant|Zero)Pad(\d)d"), "constant_pad_nd"),
]


def tensor_val(node: object) -> torch.Tensor | None:
    """The fake tensor a node carries in ``meta['val']``, or None (non-nodes, non-tensors)."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def size_hint(dim: int | torch.SymInt) -> int:
    """A concrete size for a (possibly symbolic) dimension: its example value, else 64."""
    if isinstance(dim, int):
        return dim
    hint = getattr(getattr(dim, "node", None), "hint", None)
    return int(hint) if hint is not None else 64


def strip_inplace(name: str) -> str:
    """``add_`` → ``add``; dunders such as ``__and__`` stay as they are."""
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def is_aten_name(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def op_key(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    """The rule-file key of a call node (see the module docstring)."""
    if node.op == "call_module":
        return module_key(gm.get_submodule(node.target), node)
    if node.op == "call_method":
        return method_key(node.target)
    return function_key(node)


def function_key(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        qualified = (target._schema.name if isinstance(target, torch._ops.OpOverload)
                     else target._qualified_op_name)
        namespace, _, name = qualified.partition("::")
        name = strip_inplace(name)
        if namespace == "aten":
            return _ATEN_VIEW_ALIASES.get(name, name)
        return f"{namespace}::{name}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order::{target.name()}"
    if target in _OPERATOR_KEYS:
        return _OPERATOR_KEYS[target]
    if target is operator.getitem:
        return "index"
    name = getattr(target, "__name__", str(target))
    if name == "interpolate":
        return _interpolate_key(node)
    name = _FUNCTION_ALIASES.get(name, name)
    if not is_aten_name(name) and is_aten_name(name.lstrip("_")):
        name = name.lstrip("_")
    return strip_inplace(name) if is_aten_name(strip_inplace(name)) else _qualname(target)


def method_key(name: str) -> str:
    if name in _CONVERSION_METHODS or name == "type":
        return "to"
    return strip_inplace(name)


def module_key(module: nn.Module, node: torch.fx.Node | None = None) -> str:
    cls = type(module)
    if cls in _MODULE_KEYS:
        return _MODULE_KEYS[cls]
    if isinstance(module, nn.Upsample) and node is not None:
        return _interpolate_key(node, module.mode)
    for pattern, key in _MODULE_FAMILIES:
        match = pattern.fullmatch(cls.__name__)
        if match:
            return key.format(n=match.group(1))
    return _qualname(cls)


def _interpolate_key(node: torch.fx.Node, mode: str | None = None) -> str:
    mode = mode or node.kwargs.get("mode", "nearest")
    val = node.args[0].meta.get("val") if node.args and isinstance(
        node.args[0], torch.fx.Node) else None
    n = val.dim() - 2 if isinstance(val, torch.Tensor) else 2
    return _INTERPOLATE_KEYS.get(mode, f"upsample_{mode}").format(n=n)


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"


# ------------------------------------------------------------------------- dtype arguments


def explicit_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The output dtype a node's own arguments fix (conversions, factories), else None."""
    if node.op == "call_method" and node.target in _CONVERSION_METHODS:
        return _CONVERSION_METHODS[node.target]
    if node.op == "call_method" and node.target in ("to", "type"):
        return next((a for a in (*node.args[1:], *node.kwargs.values())
                     if isinstance(a, torch.dtype)), None)
    dtype = node.kwargs.get("dtype")
    if dtype is None and isinstance(node.target, torch._ops.OpOverload):
        index = _schema_index(node.target, "dtype")
        if index is not None and index < len(node.args):
            dtype = node.args[index]
    return dtype if isinstance(dtype, torch.dtype) else None


def set_explicit_dtype(node: torch.fx.Node, dtype: torch.dtype) -> None:
    """Retype a conversion or factory: make its own dtype argument say ``dtype``."""
    if node.op == "call_method" and node.target in _CONVERSION_METHODS:
        node.target, node.args = "to", (node.args[0], dtype)
        return
    if "dtype" in node.kwargs:
        node.update_kwarg("dtype", dtype)
        return
    for i, arg in enumerate(node.args):
        if isinstance(arg, torch.dtype):
            node.update_arg(i, dtype)
            return
    raise ValueError(f"{node.name} has no dtype argument to retype")


def _schema_index(op: torch._ops.OpOverload, name: str) -> int | None:
    return next((i for i, arg in enumerate(op._schema.arguments)
                 if arg.name == name and not arg.kwarg_only), None)


# Conversions and factories: their dtype argument only says how the result is stored, so the
# pass may retype one to the low dtype when every reader runs low (docs/design.md §4).
RETYPABLE = frozenset({
    "to", "_to_copy", "zeros", "ones", "full", "empty", "arange", "linspace", "scalar_tensor",
    "rand", "randn", "zeros_like", "ones_like", "full_like", "empty_like", "rand_like",
    "randn_like", "new_zeros", "new_ones", "new_full", "new_empty",
})

# Elementwise ops whose kernels promote mixed float inputs to the widest (TensorIterator):
# add(x_fp16, y_fp32) computes in fp32 with no separate conversion kernel.
PROMOTING = frozenset({
    "add", "sub", "rsub", "mul", "div", "where", "maximum", "minimum", "atan2", "remainder",
    "fmod", "floor_divide", "hypot", "eq", "ne", "lt", "le", "gt", "ge", "cat", "concat",
    "concatenate", "stack",
})


def follows_other_dtype(node: torch.fx.Node) -> bool:
    """``x.type_as(y)`` / ``aten.to.other``: the output takes the dtype of the second tensor."""
    if node.op == "call_method":
        return node.target == "type_as" or (
            node.target == "to" and len(node.args) > 1 and isinstance(node.args[1], torch.fx.Node))
    return node.target in (torch.ops.aten.type_as.default, torch.ops.aten.to.other)


# ------------------------------------------------------------------------- aliasing


def mutated_argument(node: torch.fx.Node, gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The tensor argument a node writes in place, if any."""
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        for arg, value in zip(target._schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write:
                return value if isinstance(value, torch.fx.Node) else None
        return None
    first = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if node.op == "call_method" and strip_inplace(target) != target:
        return first
    if node.op == "call_function" and (target in INPLACE_OPERATORS
                                       or node.kwargs.get("inplace") is True):
        return first
    if node.op == "call_module" and getattr(gm.get_submodule(target), "inplace", False):
        return first
    return None


def is_view(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """True when the node's output may alias its first input (a view, or the input itself).

    ATen overloads say so in their schema; torch-level calls are looked up by op key, and
    count as views when any overload of that ATen op returns an alias (safe: more aliasing
    only makes the rewrite more careful).
    """
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        return _returns_alias(target)
    if node.op == "call_function" and target is operator.getitem:
        return True
    if node.op in ("call_function", "call_method", "call_module"):
        return _aten_op_may_alias(op_key(node, gm))
    return False


def _returns_alias(op: torch._ops.OpOverload) -> bool:
    returns = op._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not (
        returns[0].alias_info.is_write)


@functools.cache
def _aten_op_may_alias(key: str) -> bool:
    packet = getattr(torch.ops.aten, key, None) if "::" not in key else None
    if packet is None:
        return True  # unknown: assume it may alias
    return any(_returns_alias(getattr(packet, name)) for name in packet.overloads())


def functional_variant(node: torch.fx.Node) -> Any | None:
    """The out-of-place target for an in-place call (``aten.add_.Tensor`` → ``aten.add.Tensor``)."""
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        name = strip_inplace(target._schema.name.partition("::")[2])
        packet = getattr(torch.ops.aten, name, None) if target.namespace == "aten" else None
        overload = target._overloadname
        return getattr(packet, overload, None) if packet is not None else None
    if node.op == "call_method":
        return strip_inplace(target)
    if node.op == "call_function" and target in INPLACE_OPERATORS:
        return INPLACE_OPERATORS[target]
    return None
