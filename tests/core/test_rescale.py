"""Power-of-two shifts of hot GEMM chains (core/rescale.py), against hand-derived values."""
from amp_rewrite.core.rescale import Chain, shift


def test_the_smallest_shift_that_brings_the_peak_within_fp16s_threshold():
    # 3e5 / 4096 = 73.2: 2^6 = 64 is too little, 2^7 = 128 enough
    assert shift(Chain(peak=3e5, up_largest=40.0, down_largest=1e-3)) == 7
    assert shift(Chain(peak=4096.0, up_largest=1.0, down_largest=1.0)) is None  # fits
    assert shift(Chain(peak=8192.0, up_largest=1.0, down_largest=1.0)) == 1


def test_no_shift_where_the_weights_would_leave_fp16():
    # W_up's largest 2^-2 · 2^-10 · 2^-7 = 2^-19 < 2^-14: its significant entries underflow
    assert shift(Chain(peak=3e5, up_largest=0.25, down_largest=1e-3)) is None
    # W_down's 50 · 2^7 = 6400 > 4096: the down projection's weights go beyond the threshold
    assert shift(Chain(peak=3e5, up_largest=40.0, down_largest=50.0)) is None
