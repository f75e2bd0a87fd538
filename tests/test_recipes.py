"""The training recipes (``examples/recipes/``) run as written: HF Trainer, Lightning and
Accelerate each train a tiny GPT-2 and a tiny BERT for 50 steps with the amp_rewrite
``torch.compile`` backend, beside the same loop under ``torch.autocast`` (the oracle: its mean
loss over the last 10 steps must agree within 2%), then save and reload into the original class.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # end-to-end training runs

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "recipes"


@pytest.mark.parametrize("model", ["gpt2", "bert"])
@pytest.mark.parametrize("recipe,needs", [("hf_trainer.py", "accelerate"),
                                          ("lightning_module.py", "lightning"),
                                          ("accelerate_loop.py", "accelerate")])
def test_recipe_trains_like_autocast_and_reloads(recipe, needs, model):
    pytest.importorskip(needs)
    # Inductor's compile is the recipes' first-step cost; test_compile_backend.py covers it
    env = {**os.environ, "AMP_REWRITE_FUSED_BACKEND": "eager"}
    done = subprocess.run([sys.executable, str(RECIPES / recipe), "--model", model,
                           "--steps", "50", "--inner", "eager"], env=env, cwd=RECIPES,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mean loss of the last 10 steps" in done.stdout
    assert "reloaded into" in done.stdout
    assert "Traceback" not in done.stderr
