"""A bounded, seeded mutation fuzz of the CLI: no internal error (exit 1), no traceback.

60 mutated models (strings with invalid UTF-8, types, dims, raw data, ops, inputs,
attributes, outputs, headers, node order, initializers, local functions, flipped or
truncated bytes, malformed calibration data, weights in a side file that may be damaged or
missing), each run in-process through ``cli.main``.
``python -m benchmarks fuzz`` runs the same generator at scale.
"""
from __future__ import annotations

import pytest

from tests.models import fuzz

SEEDS = range(60)


@pytest.fixture(scope="module")
def models():
    return fuzz.seed_models()


def test_mutated_models_never_give_an_internal_error(models, tmp_path):
    outcomes = [fuzz.run_case(fuzz.make_case(seed, models), tmp_path / "work") for seed in SEEDS]
    bad = [(o.case.seed, o.case.base, o.case.mutations, o.case.flags, o.exit_code,
            o.stderr.strip()[-200:]) for o in outcomes if o.bad]
    assert not bad, bad
    # the fuzz reaches past loading: some runs rewrite, some are refused at each stage
    codes = {o.exit_code for o in outcomes}
    assert {0, 3} <= codes, codes
    assert all(o.stderr.count("amp-rewrite: error:") <= 1 for o in outcomes)


def test_fuzz_cases_are_reproducible(models):
    a, b = fuzz.make_case(7, models), fuzz.make_case(7, models)
    assert a.data == b.data and a.flags == b.flags and a.mutations == b.mutations


ZOO_RUNS = 320  # seeds 0..159, each in fp16 and bf16


@pytest.mark.slow
def test_mutated_zoo_families_never_damage_or_crash(models, tmp_path):
    """The zoo's families (SDPA and dynamic-axes exports, KV-cache decoders, the UNet
    stage, encoder-decoders) mutated and run in fp16 and bf16: no exit 1, no traceback, no
    changed input file, no output failing the full check where its input passes it."""
    bases = {**models, **fuzz.zoo_seed_models()}
    outcomes = [fuzz.run_case(fuzz.with_dtype(fuzz.make_case(seed, bases), dtype),
                              tmp_path / "work")
                for seed in range(ZOO_RUNS // 2) for dtype in ("fp16", "bf16")]
    bad = [(o.case.seed, o.case.base, o.case.mutations, o.case.flags, o.exit_code,
            o.stderr.strip()[-200:], o.input_changed, o.output_check_error)
           for o in outcomes if o.bad]
    assert not bad, bad
    # the seeds reach the zoo models, and some of those are rewritten
    assert sum(o.exit_code == 0 and o.case.base in fuzz.ZOO_SEEDS for o in outcomes) >= 10


def test_with_dtype_replaces_the_drawn_dtype(models):
    case = fuzz.make_case(0, models)
    case.flags = ["--dtype", "bf16", "--validate"]
    assert fuzz.with_dtype(case, "fp16").flags == ["--validate", "--dtype", "fp16"]
    assert fuzz.with_dtype(case, None) is case
