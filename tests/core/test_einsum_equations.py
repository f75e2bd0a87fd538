"""Which einsum equations sum over nothing (outer and broadcast products, gray like Mul)."""
import pytest

from amp_rewrite.core.precision import einsum_sums_over_nothing


@pytest.mark.parametrize(("equation", "outer"), [
    ("i,j->ij", True),              # RoPE's t ⊗ inv_freq
    ("...i,...j->...ij", True),     # batched outer product
    ("ij->ji", True),               # a transpose
    ("bi, bj -> bij", True),        # spaces
    ("ij,jk->ik", False),           # a matrix product sums over j
    ("bhqd,bhkd->bhqk", False),     # attention scores sum over d
    ("i,i->", False),               # an inner product
    ("i,j", False),                 # implicit output: not judged
])
def test_einsum_sums_over_nothing(equation: str, outer: bool) -> None:
    assert einsum_sums_over_nothing(equation) is outer
