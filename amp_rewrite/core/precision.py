"""Framework-neutral vocabulary: precisions, op classes and low-precision targets."""
from __future__ import annotations

import enum


class Precision(enum.Enum):
    """Which side of the mixed-precision split a (node, type-variable) pair runs on."""

    HIGH = "high"  # float32
    LOW = "low"  # the target: float16 or bfloat16

    # Members are singletons compared by identity; Enum's default hashes the name in Python,
    # which the planner pays hundreds of thousands of times on a large model.
    __hash__ = object.__hash__


class OpClass(enum.Enum):
    """Rule-file classes (docs/design.md §3). UNLISTED ops are treated as DENY and reported."""

    ALLOW = "allow"
    DENY = "deny"
    GRAY = "gray"
    CLEAR = "clear"
    UNLISTED = "unlisted"

    __hash__ = object.__hash__  # see Precision


class Label(enum.Enum):
    """The dtype a group runs in, in a mixed plan (``core/multilabel.py``)."""

    FP32 = "float32"
    FP16 = "float16"
    BF16 = "bfloat16"

    __hash__ = object.__hash__  # identity hash, as Precision (hot loops)


# ``dtype="mixed"``: fp16, bf16 or fp32 per node (core/multilabel.py); not a LowDtype, since
# the view's low dtype stays fp16 and bf16 is what a node takes where fp16's range is short
MIXED = "mixed"


class LowDtype(enum.Enum):
    """The low-precision target; names match numpy/onnx/torch spellings."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"

    @classmethod
    def parse(cls, text: object) -> LowDtype:
        """Accept 'fp16', 'float16', 'half', 'bf16', 'bfloat16', torch dtypes or a LowDtype."""
        if isinstance(text, LowDtype):
            return text
        key = str(text).lower().removeprefix("torch.")
        aliases = {"fp16": "float16", "half": "float16", "f16": "float16",
                   "bf16": "bfloat16"}
        key = aliases.get(key, key)
        try:
            return cls(key)
        except ValueError:
            from amp_rewrite.errors import UsageError

            raise UsageError(f"unknown low-precision dtype {text!r}: use fp16 or bf16") from None

    @classmethod
    def parse_plan(cls, text: object) -> LowDtype | str:
        """``parse``, or ``MIXED`` for 'mixed'."""
        if isinstance(text, str) and text.lower() == MIXED:
            return MIXED
        return cls.parse(text)

    @property
    def label(self) -> Label:
        return Label.FP16 if self is LowDtype.FLOAT16 else Label.BF16

    @property
    def range_threshold(self) -> float:
        """Magnitude above which a value observed in data counts as beyond this dtype: fp16's
        is 1/16 of its range (headroom for inputs the data did not show), bf16's is near
        its own. Calibration on the ONNX path and recorded activations on the torch path
        both use it; a mixed plan sends values above fp16's to bf16, above bf16's to fp32."""
        return 4096.0 if self is LowDtype.FLOAT16 else 1e37

    @property
    def max_finite(self) -> float:
        return 65504.0 if self is LowDtype.FLOAT16 else 3.3895313892515355e38


def einsum_sums_over_nothing(equation: str) -> bool:
    """Whether an einsum equation with an explicit output (``"i,j->ij"``) keeps every input
    index: an outer or broadcast product, which both adapters treat as gray like a multiply
    (decision 0032). Implicit-output equations answer False."""
    if "->" not in equation:
        return False
    inputs, output = equation.replace(" ", "").split("->")
    return set(inputs.replace(",", "").replace(".", "")) <= set(output)


def integer_conversion_reason(op: str, source: str) -> str:
    """Why a conversion of integers wider than 8 bits to float32 stays fp32 (a deny source in
    both adapters, decision 0032)."""
    return (f"{op} converts {source} integers (positions, timesteps): above 256 they are not "
            "exact in bf16, above 2048 not in fp16")
