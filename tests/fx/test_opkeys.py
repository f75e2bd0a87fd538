"""Op keys: ATen, custom and higher-order ops, and symbolic_trace modules/functions/methods."""
from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from amp_rewrite.core import load_rules
from amp_rewrite.fx import opkeys


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm1d(4)
        self.act = nn.ReLU6()
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> tuple:
        y = self.act(self.bn(self.fc(x)))
        y = F.gelu(y) + torch.relu(y) * 2.0 / y.abs().add_(1.0)
        z = self.pool(self.conv(img)).flatten(1)
        return y.softmax(-1).float(), z @ z.t(), x[:, 0], F.interpolate(img, scale_factor=2.0)


def _keys(gm: torch.fx.GraphModule) -> dict[str, str]:
    return {n.name: opkeys.op_key(n, gm) for n in gm.graph.nodes
            if n.op in ("call_function", "call_method", "call_module")}


def test_symbolic_trace_modules_functions_methods_map_to_aten_names():
    gm = torch.fx.symbolic_trace(_Mixed())
    keys = _keys(gm)
    assert keys["fc"] == "linear" and keys["conv"] == "conv2d" and keys["bn"] == "batch_norm"
    assert keys["act"] == "hardtanh" and keys["pool"] == "adaptive_avg_pool2d"
    assert keys["gelu"] == "gelu" and keys["relu"] == "relu"
    assert keys["add"] == "add" and keys["mul"] == "mul" and keys["truediv"] == "div"
    assert keys["abs_1"] == "abs" and keys["add_"] == "add"  # in-place method → functional key
    assert keys["softmax"] == "softmax" and keys["float_1"] == "to"
    assert keys["matmul"] == "matmul" and keys["getitem"] == "index"
    assert keys["interpolate"] == "upsample_nearest2d"


def test_export_graph_keys_are_aten_names_without_namespace_or_overload():
    module = _Mixed().eval()
    args = (torch.randn(3, 4), torch.randn(2, 1, 6, 6))
    gm = torch.export.export(module, args, strict=False).module()
    keys = set(_keys(gm).values())
    assert {"linear", "batch_norm", "hardtanh", "gelu", "conv2d", "softmax", "matmul",
            "upsample_nearest2d"} <= keys
    aten = [opkeys.op_key(n, gm) for n in gm.graph.nodes if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload)]
    assert all("." not in k and "::" not in k and opkeys.is_aten_name(k) for k in aten)


def test_custom_and_higher_order_ops_are_namespaced():
    lib = torch.library.Library("amp_rewrite_test", "FRAGMENT")
    lib.define("scale(Tensor x) -> Tensor")
    lib.impl("scale", lambda x: x * 2, "CompositeExplicitAutograd")
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    custom = graph.call_function(torch.ops.amp_rewrite_test.scale.default, (x,))
    hop = graph.call_function(torch.ops.higher_order.wrap_with_set_grad_enabled, (False, x))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    assert opkeys.op_key(custom, gm) == "amp_rewrite_test::scale"
    assert opkeys.op_key(hop, gm) == "higher_order::wrap_with_set_grad_enabled"


def test_every_autocast_cuda_list_op_has_a_class():
    """AT_FORALL_LOWER_PRECISION_FP → allow, AT_FORALL_FP32(+SET_OPT_DTYPE) → deny, promote → gray."""
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    lists = _autocast_lists(header.read_text())
    rules = load_rules("torch", env={})
    for list_name, expected in (("LOWER_PRECISION_FP", "allow"), ("FP32", "deny"),
                                ("FP32_SET_OPT_DTYPE", "deny"), ("PROMOTE", "gray")):
        assert lists[list_name], list_name
        for op in lists[list_name]:
            assert rules.class_of(op).value == expected, (list_name, op)


def _autocast_lists(text: str) -> dict[str, set[str]]:
    """Op names of each ``#define AT_FORALL_<NAME>(_)`` macro in autocast_mode.h."""
    lists: dict[str, set[str]] = {}
    for match in re.finditer(r"#define AT_FORALL_(\w+)\(_\)((?:.*\\\n)*.*)", text):
        lists[match.group(1)] = set(re.findall(r"_\((\w+)", match.group(2)))
    return lists


def test_explicit_dtype_of_conversions_and_factories():
    gm = torch.export.export(_Conversions(), (torch.randn(2, 3),), strict=False).module()
    dtypes = {n.name: opkeys.explicit_dtype(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.float64 in dtypes.values() and torch.float16 in dtypes.values()
    assert dtypes["add"] is None


class _Conversions(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple:
        return x.to(torch.float64), torch.zeros(2, dtype=torch.float16), x + 1


def test_cpu_overlay_only_relaxes_ops_the_cuda_lists_deny():
    """rules/torch_cpu.toml moves fp32-computing CPU kernels from deny to gray, and follows
    CPU autocast where its lists differ from CUDA's (allow → gray, promote → deny)."""
    from amp_rewrite.core import parse_rule_file
    from amp_rewrite.core.rules import default_rules_path

    base = load_rules("torch", env={})
    overlay = parse_rule_file(default_rules_path("torch_cpu"))
    moves = {(base.class_of(e.op).value, e.op_class.value) for e in overlay}
    assert overlay and moves == {("deny", "gray"), ("allow", "gray"), ("gray", "deny")}
    assert all(e.reason for e in overlay)
