"""The examples run as written: what a new user copies must not crash."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the examples end to end

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_hf_causal_lm_training_example_runs(dtype):
    pytest.importorskip("transformers")
    # regions run eager here: Inductor's compile is the example's first-step cost, and
    # tests/fx/test_fusion.py covers the compiled regions
    env = {**os.environ, "AMP_REWRITE_FUSED_BACKEND": "eager"}
    done = subprocess.run([sys.executable, str(EXAMPLES / "train_hf_causal_lm.py"),
                           "--dtype", dtype, "--steps", "6"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "eval loss" in done.stdout and "reloaded fp32 eval loss" in done.stdout
    assert "Traceback" not in done.stderr
    assert done.stderr.count("use_cache=False") == 1  # one line, for two captures


def test_readme_torch_example_runs_as_written(tmp_path):
    """The first code block of README's "Python (torch)" section, verbatim."""
    pytest.importorskip("transformers")
    import re

    readme = (EXAMPLES.parent / "README.md").read_text()
    section = readme[readme.index("### Python (torch)"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "readme_torch.py"
    script.write_text(code)
    env = {**os.environ, "AMP_REWRITE_FUSED_BACKEND": "eager"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "linear (linear" in done.stdout  # explain's answer
