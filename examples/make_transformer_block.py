"""Build the quick-start example: one FP32 pre-LN transformer encoder block as ONNX.

    x = x + MHA(LayerNorm(x));  x = x + MLP(LayerNorm(x)),  MLP = Linear -> GELU -> Linear

d_model 64, 4 heads, MLP 256, sequence 16, batch 2; weights and inputs from a fixed seed.
Attention is written out (MatMul, scale, Softmax, MatMul) rather than calling
``scaled_dot_product_attention``, so the exported graph shows every op a mixed-precision pass
must decide on.  Writes ``transformer_block.onnx`` (weights inside, no external data) and
``transformer_block_inputs.npz`` (keys = ONNX input names) next to this script, then checks
the ONNX model against torch in onnxruntime.

    python examples/make_transformer_block.py [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

D_MODEL, HEADS, MLP, SEQ, BATCH, SEED = 64, 4, 256, 16, 2, 0


class PreLNBlock(nn.Module):
    """One pre-LayerNorm transformer encoder block."""

    def __init__(self, d_model: int = D_MODEL, heads: int = HEADS, mlp: int = MLP) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, mlp)
        self.fc2 = nn.Linear(mlp, d_model)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        out = torch.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, s, d))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states + self.attention(self.ln1(hidden_states))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


def build() -> tuple[PreLNBlock, torch.Tensor]:
    """The block (seeded weights, eval mode) and a seeded input batch."""
    torch.manual_seed(SEED)
    block = PreLNBlock().eval()
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(SEED))
    return block, x


def export(out_dir: Path) -> tuple[Path, Path]:
    block, x = build()
    onnx_path = out_dir / "transformer_block.onnx"
    program = torch.onnx.export(
        block, (x,), dynamo=True, opset_version=18, output_names=["output"], verbose=False
    )
    program.save(str(onnx_path), external_data=False)
    inputs_path = out_dir / "transformer_block_inputs.npz"
    np.savez(inputs_path, hidden_states=x.numpy())
    return onnx_path, inputs_path


def check(onnx_path: Path, inputs_path: Path) -> float:
    """Max relative error of onnxruntime vs torch on the saved inputs."""
    import onnx
    import onnxruntime as ort

    proto = onnx.load(str(onnx_path))
    onnx.checker.check_model(proto, full_check=True)
    feeds = dict(np.load(inputs_path))
    names = [i.name for i in proto.graph.input]
    if sorted(names) != sorted(feeds):
        raise RuntimeError(f"ONNX inputs {names} != npz keys {sorted(feeds)}")
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, feeds)
    block, _ = build()
    with torch.no_grad():
        want = block(torch.from_numpy(feeds["hidden_states"])).numpy()
    return float(np.abs(got - want).max() / np.abs(want).max())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args(argv)
    onnx_path, inputs_path = export(args.out_dir)
    err = check(onnx_path, inputs_path)
    size_kb = onnx_path.stat().st_size / 1024
    print(f"{onnx_path} ({size_kb:.0f} KB), {inputs_path}; ORT max rel err {err:.1e}")
    return 0 if err <= 1e-4 and size_kb < 500 else 1


if __name__ == "__main__":
    sys.exit(main())
