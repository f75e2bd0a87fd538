"""Fusion rules onnxscript has no equivalent for, in its ``pattern / check / rewrite`` style.

* tanh-GELU in the order HF's ``gelu_new`` and torch's ``gelu(approximate="tanh")`` export it.
* erf-GELU and tanh-GELU to the standard ``Gelu`` (opset 20) for ``target="onnx"``.
* QuickGELU / SiLU: ``x · sigmoid(α·x)`` (α = 1.702; SiLU, α = 1).
* FastGelu with its bias input: ``FastGelu(x + b)`` → ``FastGelu(x, b)``.
* onnxscript's intermediate SDPA call → the standard ``Attention`` (opset 23), ``target="onnx"``.

Constants are pattern variables checked with a relative tolerance, as exporters round them.
"""
from __future__ import annotations

import math

import onnx_ir as ir
from onnxscript.rewriter import _ir_utils, pattern

MS_DOMAIN = "com.microsoft"
SDPA_DOMAIN = "ai.onnxruntime._fusion"  # where onnxscript's SDPA rule puts its function call
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TOLERANCE = 1e-4


def _is_const(value: ir.Value | None, expected: float) -> bool:
    got = _ir_utils.get_singleton_value(value)
    return isinstance(got, (int, float)) and math.isclose(got, expected, rel_tol=_TOLERANCE)


def _is_float(x: ir.Value) -> bool:
    return x.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _either(op_fn, a, b):
    """``op(a, b)`` or ``op(b, a)``: one rule with a branch instead of ``commute()``'s 2^n
    rules (matching cost grows with the number of rules times the number of nodes)."""
    return pattern.OrValue([op_fn(a, b), op_fn(b, a)])


def _tanh_gelu_inner(op, x, exponent, cube_coeff, sqrt_2_over_pi, one):
    cube = pattern.OrValue([op.Pow(x, exponent), op.Mul(op.Mul(x, x), x)],
                           tag_var="cube_form", tag_values=["pow", "mul"])
    inner = _either(op.Mul, _either(op.Add, x, _either(op.Mul, cube, cube_coeff)),
                    sqrt_2_over_pi)
    return _either(op.Add, op.Tanh(inner), one)


def _root_mul(op, a, b, swap: bool):
    return op.Mul(b, a) if swap else op.Mul(a, b)


def _gelu_product(op, form, x, half, one_plus, swap: bool):
    """The three places exporters put the 0.5 of GELU. A rule's root cannot be an OrValue,
    so the root Mul's operand order is a rule parameter (``swap``)."""
    if form == "half_x":
        return _root_mul(op, _either(op.Mul, x, half), one_plus, swap)
    if form == "half_t":
        return _root_mul(op, x, _either(op.Mul, one_plus, half), swap)
    return _root_mul(op, _either(op.Mul, x, one_plus), half, swap)


class TanhGeluFusion(pattern.RewriteRuleClassBase):
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) → FastGelu (ORT) or Gelu(tanh) (opset 20).

    ``form``: where the 0.5 sits: ``"half_x"`` (0.5·x)·(1+t), ``"half_t"`` x·(0.5·(1+t)),
    ``"outer"`` (x·(1+t))·0.5.
    """

    def __init__(self, name: str, form: str, standard: bool, swap: bool) -> None:
        super().__init__(name)
        self._form, self._standard, self._swap = form, standard, swap

    def pattern(self, op, x, half, exponent, cube_coeff, sqrt_2_over_pi, one):
        one_plus_tanh = _tanh_gelu_inner(op, x, exponent, cube_coeff, sqrt_2_over_pi, one)
        return _gelu_product(op, self._form, x, half, one_plus_tanh, self._swap)

    def check(self, context, x, half, exponent, cube_coeff, sqrt_2_over_pi, one, cube_form,
              **_):
        result = pattern.MatchResult()
        if not _is_float(x):
            return result.fail("input is not a floating-point tensor", x)
        constants = ((half, 0.5), (cube_coeff, 0.044715), (sqrt_2_over_pi, _SQRT_2_OVER_PI),
                     (one, 1.0))
        for value, expected in constants:
            if not _is_const(value, expected):
                return result.fail(f"constant is not {expected}", value)
        if cube_form == "pow" and not _is_const(exponent, 3.0):
            return result.fail("the power is not 3", exponent)
        return result

    def rewrite(self, op, x, **_):
        if self._standard:
            return op.Gelu(x, approximate="tanh")
        return op.FastGelu(x, _domain=MS_DOMAIN)


class ErfGeluFusion(pattern.RewriteRuleClassBase):
    """0.5·x·(1 + erf(x/√2)) (any order of the products) → Gelu (opset 20 or com.microsoft)."""

    def __init__(self, name: str, form: str, standard: bool, swap: bool) -> None:
        super().__init__(name)
        self._form, self._standard, self._swap = form, standard, swap

    def pattern(self, op, x, half, scale, one):
        scaled = pattern.OrValue([op.Div(x, scale), op.Mul(x, scale), op.Mul(scale, x)],
                                 tag_var="scale_op", tag_values=["div", "mul", "mul"])
        one_plus_erf = _either(op.Add, op.Erf(scaled), one)
        return _gelu_product(op, self._form, x, half, one_plus_erf, self._swap)

    def check(self, context, x, half, scale, one, scale_op, **_):
        result = pattern.MatchResult()
        if not _is_float(x):
            return result.fail("input is not a floating-point tensor", x)
        expected_scale = math.sqrt(2.0) if scale_op == "div" else 1.0 / math.sqrt(2.0)
        for value, expected in ((half, 0.5), (scale, expected_scale), (one, 1.0)):
            if not _is_const(value, expected):
                return result.fail(f"constant is not {expected}", value)
        return result

    def rewrite(self, op, x, **_):
        if self._standard:
            return op.Gelu(x)
        return op.Gelu(x, _domain=MS_DOMAIN)


class QuickGeluFusion(pattern.RewriteRuleClassBase):
    """x·sigmoid(α·x) → com.microsoft QuickGelu(alpha=α); α = 1 (SiLU) is ``x·sigmoid(x)``."""

    def __init__(self, name: str, scaled: bool, swap: bool) -> None:
        super().__init__(name)
        self._scaled, self._swap = scaled, swap

    def pattern(self, op, x, alpha):
        gate = op.Sigmoid(_either(op.Mul, x, alpha) if self._scaled else x)
        return _root_mul(op, x, gate, self._swap)

    def check(self, context, x, alpha, **_):
        result = pattern.MatchResult()
        if not _is_float(x):
            return result.fail("input is not a floating-point tensor", x)
        if self._scaled:
            value = _ir_utils.get_singleton_value(alpha)
            if not isinstance(value, float) or value <= 0:
                return result.fail("alpha is not a positive scalar constant", alpha)
        return result

    def rewrite(self, op, x, alpha, **_):
        value = float(_ir_utils.get_singleton_value(alpha)) if self._scaled else 1.0
        return op.QuickGelu(x, alpha=value, _domain=MS_DOMAIN)


class FastGeluBiasFusion(pattern.RewriteRuleClassBase):
    """FastGelu(x + b) with a 1-D constant bias → FastGelu(x, b) (one kernel, no Add)."""

    def pattern(self, op, x, bias):
        return op.FastGelu(op.Add(x, bias), _domain=MS_DOMAIN)

    def check(self, context, x, bias, **_):
        result = pattern.MatchResult()
        if bias.const_value is None or not _ir_utils.has_rank(bias, 1):
            return result.fail("bias is not a 1-D constant", bias)
        if x.shape is None or x.shape.rank() is None or bias.shape is None \
                or x.shape[-1] != bias.shape[0]:
            return result.fail("bias does not match the last dimension of x", bias)
        return result

    def rewrite(self, op, x, bias, **_):
        return op.FastGelu(x, bias, _domain=MS_DOMAIN)


def gelu_rules(standard: bool) -> pattern.RewriteRuleSet:
    """erf- and tanh-GELU in all operand orders (Add/Mul operands in either order)."""
    prefix = "onnx" if standard else "ort"
    rules = []
    for form in ("half_x", "half_t", "outer"):
        for swap in (False, True):
            rules.append(ErfGeluFusion.rule(f"{prefix}_erf_gelu_{form}", form=form,
                                            standard=standard, swap=swap))
            rules.append(TanhGeluFusion.rule(f"{prefix}_tanh_gelu_{form}", form=form,
                                             standard=standard, swap=swap))
    return pattern.RewriteRuleSet(rules)


def quick_gelu_rules() -> pattern.RewriteRuleSet:
    return pattern.RewriteRuleSet([
        QuickGeluFusion.rule(name, scaled=scaled, swap=swap)
        for name, scaled in (("quick_gelu", True), ("silu_as_quick_gelu", False))
        for swap in (False, True)])


def fast_gelu_bias_rules() -> pattern.RewriteRuleSet:
    return pattern.RewriteRuleSet(FastGeluBiasFusion.rule("fast_gelu_bias").commute())


class SdpaToAttention(pattern.RewriteRuleClassBase):
    """onnxscript's intermediate SDPA call → the standard ``Attention`` op (opset 23).

    Both take 4-D (batch, heads, sequence, head_size) query/key/value, an additive mask, and
    scale 1/√head_size unless given; a key in (B, S, H, d) layout is transposed first.
    """

    def __init__(self, name: str, masked: bool) -> None:
        super().__init__(name)
        self._masked = masked

    def pattern(self, op, query, key, value, mask):
        inputs = [query, key, value, mask] if self._masked else [query, key, value]
        return op.SDPA(*inputs, _domain=SDPA_DOMAIN, _outputs=["sdpa_output"])

    def check(self, context, query, key, value, sdpa_output, **_):
        result = pattern.MatchResult()
        node = sdpa_output.producer()
        key_format = node.attributes.get_string("key_format", "BHSd")
        if key_format not in ("BHSd", "BSHd"):
            return result.fail(f"key format {key_format} is not supported", key)
        for v in (query, key, value):
            if v.shape is None or v.shape.rank() != 4:
                return result.fail("attention inputs are not 4-D", v)
        return result

    def rewrite(self, op, query, key, value, sdpa_output, mask=None, **_):
        node = sdpa_output.producer()
        if node.attributes.get_string("key_format", "BHSd") == "BSHd":
            key = op.Transpose(key, perm=[0, 2, 1, 3])
        scale = node.attributes.get_float("scale", None)
        attrs = {} if scale is None else {"scale": scale}
        inputs = [query, key, value] + ([mask] if self._masked else [])
        return op.Attention(*inputs, **attrs)


def sdpa_to_attention_rules() -> pattern.RewriteRuleSet:
    return pattern.RewriteRuleSet([SdpaToAttention.rule("sdpa_to_attention_masked", masked=True),
                                   SdpaToAttention.rule("sdpa_to_attention", masked=False)])
