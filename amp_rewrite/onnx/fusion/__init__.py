"""Pattern fusion before the precision plan (docs/design.md §7): spelled-out chains → fused ops.

A LayerNorm, RMSNorm or GELU written as primitive ops contains deny ops and becomes an fp32
island with casts; its fused kernel computes statistics in fp32 registers with low I/O
(decision 0007). One generic pipeline: onnxscript's rewrite rules plus our own
(``fusion.rules``), ordered so each step can build on the previous one. ``target="ort"`` may
emit onnxruntime contrib ops; ``target="onnx"`` only standard ops of the model's opset. Every
created node carries ``metadata_props[FUSED_TAG] = <step name>``.
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from amp_rewrite.errors import UsageError, described
from amp_rewrite.onnx.load import model_graphs, unlink_graph, unlink_nodes
from amp_rewrite.onnx.fusion.schemas import register_default_domain_contrib_ops, runtime_schema

logger = logging.getLogger(__name__)

TARGETS = ("ort", "onnx")
FUSED_TAG = "amp_rewrite.fused"
MS_DOMAIN = "com.microsoft"
_SDPA_DOMAIN = "ai.onnxruntime._fusion"
# Op keys (as in the rule files) that count as fused chains in the report.
FUSED_OPS = frozenset({
    "LayerNormalization", "RMSNormalization", "GroupNormalization", "Gelu", "Attention",
    "SimplifiedLayerNormalization", "RotaryEmbedding",
    *(f"{MS_DOMAIN}::{op}" for op in (
        "Gelu", "FastGelu", "BiasGelu", "QuickGelu", "SkipLayerNormalization",
        "SkipSimplifiedLayerNormalization", "MultiHeadAttention", "RotaryEmbedding",
        "GroupQueryAttention")),
})
# Fused ops whose first output has the shape of the first input.
_SHAPE_OF_INPUT0 = {"LayerNormalization", "RMSNormalization", "GroupNormalization", "Gelu",
                    "FastGelu", "BiasGelu", "QuickGelu", "SimplifiedLayerNormalization",
                    "SkipLayerNormalization", "SkipSimplifiedLayerNormalization",
                    "RotaryEmbedding", "GroupQueryAttention"}

register_default_domain_contrib_ops()


@dataclass(frozen=True)
class FusionStep:
    """One named group of rewrite rules, applied to a fixed point."""

    name: str
    anchors: frozenset[str]  # op types one of which every match contains (a cheap pre-check)
    make_rules: Callable[[], object]  # -> onnxscript RewriteRuleSet
    min_opset: int = 1
    # Passes over the model: a rewrite can expose another match of the same step. One for
    # steps that create functions (a second pass would rewrite inside their bodies).
    rounds: int = 3
    # A finer pre-check than ``anchors`` on the model's nodes; None: anchors decide alone.
    wanted: Callable[[list[ir.Node]], bool] | None = None


def _ops(*names: str) -> frozenset[str]:
    return frozenset(names)


def op_key(node: ir.Node) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def _softmax_feeds_matmul(nodes: list[ir.Node]) -> bool:
    """Whether some Softmax output reaches a MatMul directly or through the NaN guard's
    Where (the attention patterns' spine): else no attention match is tried."""
    return any(use.node.op_type == "MatMul"
               or (use.node.op_type == "Where"
                   and any(u.node.op_type == "MatMul" for u in use.node.outputs[0].uses()))
               for node in nodes if node.op_type == "Softmax" for use in node.outputs[0].uses())


def _ort_steps() -> list[FusionStep]:
    from onnxscript.rewriter import pattern
    from onnxscript.rewriter.ort_fusions import (
        bias_gelu, erfgelu, rms_normalization, sdpa, sdpa_via_mha, skip_normalization,
    )
    from onnxscript.rewriter.rules.fusion import _layer_norm

    from amp_rewrite.onnx.fusion import canonical, decoding, norms
    from amp_rewrite.onnx.fusion import rules as own

    return [
        FusionStep("ort_fusions.erfgelu", _ops("Erf"), lambda: erfgelu.rules),
        FusionStep("amp_rewrite.gelu", _ops("Erf", "Tanh"),
                   lambda: own.gelu_rules(standard=False)),
        FusionStep("amp_rewrite.quick_gelu", _ops("Sigmoid"), own.quick_gelu_rules),
        FusionStep("rules.fusion.layer_norm", _ops("ReduceMean", "LayerNormalization"),
                   lambda: _layer_norm.layer_normalization_ruleset, min_opset=17),
        # GroupNorm exported via InstanceNormalization: fp32 statistics (stash_type) at 21+
        FusionStep("amp_rewrite.group_norm", _ops("InstanceNormalization"),
                   norms.group_norm_rules, min_opset=norms.GROUP_NORM_OPSET),
        FusionStep("ort_fusions.rms_normalization", _ops("ReduceMean"),
                   lambda: rms_normalization.rms_normalization_ruleset),
        FusionStep("ort_fusions.skip_layer_normalization", _ops("LayerNormalization"),
                   lambda: skip_normalization.skip_layer_normalization_ruleset),
        FusionStep("ort_fusions.skip_rms_normalization", _ops("SimplifiedLayerNormalization"),
                   lambda: skip_normalization.skip_rms_normalization_ruleset),
        FusionStep("ort_fusions.bias_gelu", _ops("Gelu"), lambda: bias_gelu.bias_gelu_rules),
        FusionStep("amp_rewrite.fast_gelu_bias", _ops("FastGelu"), own.fast_gelu_bias_rules),
        # RoPE before attention: the SDPA/GQA patterns read the rotated Q and K.
        FusionStep("amp_rewrite.rotary_embedding", _ops("Cos"), decoding.rotary_rules,
                   wanted=decoding.has_rotary_tables),
        FusionStep("amp_rewrite.key_transpose", _ops("Transpose"), canonical.key_transpose_rules,
                   rounds=1, wanted=_softmax_feeds_matmul),
        # GQA decoders (head repeat + KV-cache Concat + causal/padding mask from
        # attention_mask) before SDPA takes their attention; declines leave it to SDPA/MHA.
        FusionStep("amp_rewrite.group_query_attention", _ops("Softmax"),
                   decoding.gqa_decode_rules, rounds=1,
                   wanted=lambda nodes: decoding.has_kv_cache(nodes)
                   and _softmax_feeds_matmul(nodes)),
        FusionStep("amp_rewrite.group_query_attention.prompt", _ops("Softmax"),
                   decoding.gqa_prompt_rules, rounds=1, wanted=_softmax_feeds_matmul),
        # SDPA is an intermediate function call; the next step turns it into
        # MultiHeadAttention and _finish inlines any call it could not convert.
        FusionStep("ort_fusions.sdpa", _ops("Softmax"),
                   lambda: pattern.RewriteRuleSet([sdpa.SDPA.rule(as_function=True)]),
                   rounds=1, wanted=_softmax_feeds_matmul),
        FusionStep("ort_fusions.sdpa_via_mha", _ops("SDPA"), lambda: sdpa_via_mha._rules,
                   rounds=1),
    ]


def _onnx_steps() -> list[FusionStep]:
    from onnxscript.rewriter import pattern
    from onnxscript.rewriter.ort_fusions import sdpa
    from onnxscript.rewriter.rules.fusion import _layer_norm, _rms_normalization

    from amp_rewrite.onnx.fusion import canonical, decoding, norms
    from amp_rewrite.onnx.fusion import rules as own

    return [
        FusionStep("amp_rewrite.gelu", _ops("Erf", "Tanh"),
                   lambda: own.gelu_rules(standard=True), min_opset=20),
        FusionStep("rules.fusion.layer_norm", _ops("ReduceMean", "LayerNormalization"),
                   lambda: _layer_norm.layer_normalization_ruleset, min_opset=17),
        FusionStep("amp_rewrite.group_norm", _ops("InstanceNormalization"),
                   norms.group_norm_rules, min_opset=norms.GROUP_NORM_OPSET),
        FusionStep("rules.fusion.rms_normalization", _ops("ReduceMean"),
                   lambda: _rms_normalization.rms_normalization_ruleset, min_opset=23),
        # RoPE before attention (as for ort): ONNX RotaryEmbedding-23 with the per-token
        # fp32 Cos/Sin of the graph's own angles as its (B, S, D/2) caches.
        FusionStep("amp_rewrite.rotary_embedding", _ops("Cos"),
                   lambda: decoding.rotary_rules("onnx"), min_opset=23,
                   wanted=decoding.has_rotary_tables),
        FusionStep("amp_rewrite.key_transpose", _ops("Transpose"), canonical.key_transpose_rules,
                   min_opset=23, rounds=1, wanted=_softmax_feeds_matmul),
        FusionStep("ort_fusions.sdpa", _ops("Softmax"),
                   lambda: pattern.RewriteRuleSet([sdpa.SDPA.rule(as_function=True)]),
                   min_opset=23, rounds=1, wanted=_softmax_feeds_matmul),
        FusionStep("amp_rewrite.sdpa_to_attention", _ops("SDPA"),
                   own.sdpa_to_attention_rules, min_opset=23, rounds=1),
        # KV-cache decoders: the Attention (this step's or the exporter's) takes past_key/
        # past_value itself and the head repeat goes (GQA through 4-D head counts).
        FusionStep("amp_rewrite.attention_kv_cache", _ops("Attention"),
                   decoding.attention23_decode_rules, min_opset=23, rounds=1,
                   wanted=lambda nodes: decoding.has_kv_cache(nodes)
                   and decoding.attention_reads_head_repeat(nodes)),
        FusionStep("amp_rewrite.attention_kv_cache.prompt", _ops("Attention"),
                   decoding.attention23_prompt_rules, min_opset=23, rounds=1,
                   wanted=decoding.attention_reads_head_repeat),
    ]


def fusion_steps(target: str, opset: int) -> list[FusionStep]:
    """The steps for a target, those the model's default-domain opset admits."""
    steps = _ort_steps() if _checked(target) == "ort" else _onnx_steps()
    return [s for s in steps if opset >= s.min_opset]


def _checked(target: str) -> str:
    if target not in TARGETS:
        raise UsageError(f"unknown fusion target {target!r}; use one of {', '.join(TARGETS)}")
    return target


def _all_nodes(model: ir.Model) -> list[ir.Node]:
    """Every node of the graph and its subgraphs (``model_graphs``: one list for a model
    without subgraphs, 3x cheaper than onnx_ir's recursive iterator)."""
    return [n for g in model_graphs(model) for n in g]


class FusionPass(ir.passes.InPlacePass):
    """Replace recognised chains by fused ops; ``self.fused`` counts fused ops by op key."""

    def __init__(self, target: str = "ort") -> None:
        super().__init__()
        self.target = _checked(target)
        self.fused: dict[str, int] = {}
        self.rule_hits: dict[str, int] = {}
        self._created: set[int] = set()  # ids of the nodes this run created

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        hits: dict[str, int] = {}
        self._created = set()
        nodes = _all_nodes(model)
        present = {n.op_type for n in nodes}
        for step in fusion_steps(self.target, opset):
            if not step.anchors & present or (step.wanted and not step.wanted(nodes)):
                continue  # no node the step's patterns need: skip matching every node
            if step.name.startswith("ort_fusions.sdpa") and _has_own_functions(model):
                # The SDPA step creates model-local functions and inlines the calls it could
                # not convert; a model with functions of its own keeps them as they are.
                logger.info("model has local functions: attention fusion skipped")
                continue
            count = self._apply(model, step, nodes)
            if count:
                hits[step.name] = count
                nodes = _all_nodes(model)
                present = {n.op_type for n in nodes}
        modified = bool(hits)
        if modified:
            _finish(model)
        self.rule_hits = hits
        self.fused = fused_counts(model, self._created) if self._created else {}
        return ir.passes.PassResult(model, modified=modified)

    def _apply(self, model: ir.Model, step: FusionStep, before_nodes: list[ir.Node]) -> int:
        from onnxscript.rewriter import pattern

        before = set(map(id, before_nodes))
        rules = pattern.RewriteRuleSet([_RootFiltered(r, step.name)
                                        for r in step.make_rules().rules])
        total = 0
        try:
            for _ in range(step.rounds):
                count = rules.apply_to_model(model)
                total += count
                if not count:
                    break
        except Exception as e:  # noqa: BLE001 - a rule that fails while rewriting declines
            _decline_once(step.name, e)
            broken = _dangling_input(model)
            if broken is not None:  # a rewrite stopped half way: not recoverable here
                raise FusionError(f"fusion rule {step.name} failed half way ({e}) and left "
                                  f"{broken}; rerun with --no-fuse") from e
        finally:
            _forget_matches(rules)
        if not total:
            return 0
        for node in _all_nodes(model):
            if id(node) not in before:
                self._created.add(id(node))
                node.metadata_props[FUSED_TAG] = step.name
                _type_outputs(node, model)
        unlink_nodes([n for n in before_nodes if n.graph is None])
        logger.info("fusion %s: %d", step.name, total)
        return total


def _has_own_functions(model: ir.Model) -> bool:
    return any(f.domain != _SDPA_DOMAIN for f in model.functions.values())


def _finish(model: ir.Model) -> None:
    """Inline SDPA calls no later step converted, drop unused functions, import the domain."""
    if any(n.domain == _SDPA_DOMAIN for n in _all_nodes(model)):
        common_passes.InlinePass()(model)
    for key in [k for k, f in model.functions.items() if f.domain == _SDPA_DOMAIN]:
        function = model.functions.pop(key)
        unlink_graph(function.graph)  # see load.release
        function.attributes._owner = None
    model.opset_imports.pop(_SDPA_DOMAIN, None)
    if any(n.domain == MS_DOMAIN for n in _all_nodes(model)):
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    common_passes.RemoveUnusedNodesPass()(model)
    for node in _all_nodes(model):
        if FUSED_TAG in node.metadata_props:
            _drop_unused_outputs(node)
            _type_outputs(node, model)


class FusionError(RuntimeError):
    """A fusion rule failed in the middle of a rewrite and left the graph inconsistent."""


_DECLINED: set[tuple[str, str]] = set()  # (rule, reason) pairs already warned about


def _decline_once(rule: str, error: BaseException) -> None:
    """One WARNING per rule and kind of failure per process: the rule declines and the
    rewrite goes on with the graph as that rule found it."""
    reason = described(error)
    if (rule, type(error).__name__) in _DECLINED:
        logger.debug("fusion rule %s declined: %s", rule, reason)
        return
    _DECLINED.add((rule, type(error).__name__))
    logger.warning("fusion rule %s cannot apply here and was skipped (%s)", rule, reason)


class _RootFiltered:
    """A rewrite rule that declines a node whose op type is not the pattern's root before
    matching (onnxscript tries every rule on every node), and declines instead of raising
    wherever the rule fails before the graph is touched (``_unextractable`` included)."""

    def __init__(self, rule, step: str) -> None:
        self._rule = rule
        self._step = step
        # onnxscript matches the node it is given against the pattern's first output node
        # (the others by trying node combinations), so that node's op type is a sure filter
        first = rule._target_pattern.output_nodes[0].op_identifier()
        self._root_ops = None if first is None else {first[1]}

    def try_rewrite(self, model, graph_or_function, node, **kwargs):
        if self._root_ops is not None and node.op_type not in self._root_ops:
            return None
        try:
            delta = self._rule.try_rewrite(model, graph_or_function, node, **kwargs)
        except Exception as e:  # noqa: BLE001 - onnxscript rules raise many types
            _decline_once(self._rule.name or self._step, e)
            return None
        if delta and getattr(self._rule, "as_function", False):
            free = _unextractable(delta)
            if free is not None:
                _decline_once(self._rule.name or self._step, ValueError(
                    f"the match reads {free}, which is computed outside it"))
                return None
        return delta

    def __getattr__(self, name: str):
        return getattr(self._rule, name)


def _unextractable(delta) -> ir.Value | None:
    """A value the matched nodes read that ``as_function`` cannot carry into the function:
    not made by a matched node, not a replacement input, not a constant (onnxscript would
    raise "not found in value_map" after the rewrite began). None if there is none."""
    if len(delta.new_nodes) != 1:
        return None  # onnxscript refuses these itself, before changing anything
    known = {id(v) for v in delta.new_nodes[0].inputs if v is not None}
    known.update(id(v) for n in delta.match.nodes for v in n.outputs)
    for node in delta.match.nodes:
        for value in node.inputs:
            if value is not None and id(value) not in known and value.const_value is None:
                return value
    return None


def _dangling_input(model: ir.Model) -> str | None:
    """A description of the first node input that no node, graph input or initializer of
    the model provides (a half-applied rewrite), else None. Subgraphs read outer values, so
    all graphs provide for all: an O(nodes) check that misses only cross-branch reads."""
    graphs = model_graphs(model)
    provided = set()
    for graph in graphs:
        provided.update(id(v) for v in graph.inputs)
        provided.update(id(v) for v in graph.initializers.values())
        provided.update(id(v) for n in graph for v in n.outputs)
    for graph in graphs:
        for node in graph:
            for value in node.inputs:
                if value is not None and id(value) not in provided:
                    return f"{node.op_type} node {node.name!r} reading {value.name!r}"
    return None


def _forget_matches(rules) -> None:
    """onnxscript's matchers keep the graph, node and match they saw last; its rule sets are
    module-level objects, so that would keep the whole model alive after the rewrite."""
    for rule in rules.rules:
        matcher = getattr(rule, "_matcher", None)
        for attr in ("_graph", "_current_node", "_match"):
            if hasattr(matcher, attr):
                setattr(matcher, attr, None)


def _drop_unused_outputs(node: ir.Node) -> None:
    """Omit optional outputs nobody reads (the skip norms' float32 mean and inv_std_var):
    an empty output name tells the runtime not to produce them, and the output carries no
    high-precision value that the plan or the report would have to account for."""
    for value in node.outputs[1:]:
        if value.name and not value.uses() and not value.is_graph_output():
            value.name, value.type, value.shape = "", None, None


def fused_counts(model: ir.Model, created: set[int] | None = None) -> dict[str, int]:
    """Fused ops by op key (``{"com.microsoft::SkipLayerNormalization": 4}``): those tagged by
    the fusion step, and of those only the ``created`` ones (node ids) if given."""
    counts = collections.Counter(
        op_key(n) for n in _all_nodes(model)
        if FUSED_TAG in n.metadata_props and op_key(n) in FUSED_OPS
        and (created is None or id(n) in created))
    return dict(sorted(counts.items()))


def _type_outputs(node: ir.Node, model: ir.Model) -> None:
    """Dtypes (and the obvious shapes) of a fused node's outputs: ONNX shape inference does
    not know contrib ops, and the plan needs every dtype and, for cast costs, sizes."""
    from amp_rewrite.onnx.ports import infer_output_dtypes, node_opset

    infer_output_dtypes(node, node_opset(node, dict(model.opset_imports)))
    first = node.inputs[0] if node.inputs else None
    out = node.outputs[0]
    if first is None or out.shape is not None:
        return
    if node.op_type in _SHAPE_OF_INPUT0:
        out.shape = first.shape
        if node.op_type.startswith("Skip") and len(node.outputs) > 3:
            node.outputs[3].shape = first.shape
    elif node.op_type == "MultiHeadAttention":
        out.shape = _mha_output_shape(node)
    elif node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
        out.shape = _attention_output_shape(node)


def _attention_output_shape(node: ir.Node) -> ir.Shape | None:
    """(batch, heads, q_sequence, v_head_size) for 4-D standard Attention inputs."""
    q, v = node.inputs[0], node.inputs[2]
    if q is None or v is None or q.shape is None or v.shape is None:
        return None
    if len(q.shape) == 4 and len(v.shape) == 4:
        return ir.Shape([q.shape[0], q.shape[1], q.shape[2], v.shape[3]])
    return None


def _mha_output_shape(node: ir.Node) -> ir.Shape | None:
    """(batch, q_sequence, v_hidden) for 3-D query/key/value (the BSD layout)."""
    q, v = node.inputs[0], node.inputs[2] if len(node.inputs) > 2 else None
    if q is None or v is None or q.shape is None or v.shape is None:
        return None
    if len(q.shape) == 3 and len(v.shape) == 3:
        return ir.Shape([q.shape[0], q.shape[1], v.shape[2]])
    return None


__all__ = ["FUSED_OPS", "FUSED_TAG", "FusionPass", "TARGETS", "fused_counts", "fusion_steps",
           "runtime_schema"]
