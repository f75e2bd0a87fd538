"""KV-cache decoders (bench.decoders) through the CLI, and ``low_io`` for their cache.

Every oracle here is PyTorch float32 on the same inputs (``decoders.torch_reference``), which
the ONNX path does not compute; errors are max |got - ref| / max |ref| over all outputs.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from amp_rewrite.cli import main
from amp_rewrite.onnx.fusion import schemas  # noqa: F401 - registers ORT's contrib schemas
from benchmarks import deployed
from tests.models import decoders

TOLERANCE = 1e-2
# bf16 keeps 8 mantissa bits (unit roundoff 2^-9): the prefill's logits reach 1.2e-2 with or
# without fusion (docs/decisions/0031b-llm-decoding.md), so bf16 gets its own tolerance.
TOLERANCES = {"fp16": TOLERANCE, "bf16": 2e-2}
LONG_PAST = 1000
NAMES = sorted(decoders.DECODERS)


@pytest.fixture(scope="module", params=NAMES)
def exported(request):
    return request.param, decoders.cached_decoder(request.param)


def _error_vs_torch(model: onnx.ModelProto, name: str, run, past: int) -> float:
    feeds = decoders.inputs(name, past=past)
    return deployed.relative_error(run(model, feeds), decoders.torch_reference(name, feeds))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cli_decoder_within_tolerance_of_torch(exported, dtype, tmp_path, capsys):
    name, path = exported
    out = tmp_path / "out.onnx"
    assert main([str(path), "-o", str(out), "--dtype", dtype, "-q"]) == 0, capsys.readouterr()
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    gqa = sum(n.op_type == "GroupQueryAttention" for n in model.graph.node)
    assert gqa == (decoders.LAYERS if name in GQA_NAMES else 0), gqa
    pasts = [decoders.PAST, LONG_PAST] if decoders.spec(name).has_past else [0]
    for past in pasts:
        error = _error_vs_torch(model, name, deployed.run_reference, past)
        assert error <= TOLERANCES[dtype], (past, error)
    if dtype == "fp16":  # ORT's CPU provider has almost no bf16 kernels
        assert _error_vs_torch(model, name, deployed.run_ort, pasts[-1]) <= TOLERANCE


@pytest.mark.slow
def test_low_io_cache_is_fp16_and_32_chained_steps_stay_accurate(tmp_path, capsys):
    name = "llama-decode"
    out = tmp_path / "out.onnx"
    args = [str(decoders.cached_decoder(name)), "-o", str(out),
            "--low-io", "past_key_values.*,present.*"]
    assert main(args) == 0
    summary = capsys.readouterr().out
    assert "low-precision I/O" in summary and "8 values" in summary, summary
    model = onnx.load(str(out))
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*model.graph.input, *model.graph.output]}
    fp16, fp32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    assert {types[n] for n in types if n.startswith(("past_key_values.", "present."))} == {fp16}
    assert types["logits"] == fp32  # the rest keep their types
    assert sum(n.op_type == "GroupQueryAttention" for n in model.graph.node) == decoders.LAYERS
    assert deployed.chained_error(model, name, run=deployed.run_ort) <= TOLERANCE
    assert deployed.chained_error(model, name, run=deployed.run_reference) <= TOLERANCE


@pytest.mark.slow
def test_low_io_whisper_cross_cache_also_low(tmp_path):
    from amp_rewrite.onnx.api import rewrite_onnx_model

    path = decoders.cached_decoder("whisper-decode")
    result = rewrite_onnx_model(path, low_io=["past_key_values.*.encoder.*"])
    low = {v.name for v in result.model.graph.inputs if v.dtype is not None
           and v.dtype.name == "FLOAT16"}
    assert low == {f"past_key_values.{i}.encoder.{kv}" for i in range(decoders.LAYERS)
                   for kv in ("key", "value")}
    assert set(result.report["low_io"]["values"]) == low


def test_low_io_report_counts_bytes_saved_by_symbolic_dims():
    from amp_rewrite.onnx.api import rewrite_onnx_model

    model = onnx.parser.parse_model("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[b, 4, p, 8] past, float[b, 4] x) => (float[b, 4, p, 8] present, float[b, 4] y) {
        present = Identity(past)
        y = Relu(x)
    }""")
    result = rewrite_onnx_model(model, low_io=["past", "present,nothing*"])
    assert result.report["low_io"] == {"values": ["past", "present"],
                                       "bytes_saved": {"b*p": 2 * 2 * 4 * 8}}
    types = {v.name: v.dtype.name for v in [*result.model.graph.inputs,
                                            *result.model.graph.outputs]}
    assert types == {"past": "FLOAT16", "x": "FLOAT", "present": "FLOAT16", "y": "FLOAT"}


@pytest.mark.slow
def test_no_low_io_keeps_cache_types():
    from amp_rewrite.onnx.api import rewrite_onnx_model

    result = rewrite_onnx_model(decoders.cached_decoder("llama-decode"))
    assert {v.dtype.name for v in result.model.graph.inputs
            if v.name.startswith("past_key_values.")} == {"FLOAT"}
    assert result.report["low_io"] == {}


@pytest.mark.slow
def test_decoder_exports_match_torch_in_fp32():
    """The export itself (the harness the other tests trust) against PyTorch."""
    import onnxruntime  # noqa: F401

    path = decoders.cached_decoder("qwen2-decode")
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == decoders.input_names("qwen2-decode")
    assert [o.name for o in model.graph.output] == decoders.output_names("qwen2-decode")
    assert _error_vs_torch(model, "qwen2-decode", deployed.run_ort, LONG_PAST) < 1e-5
    assert np.isfinite(decoders.inputs("qwen2-decode")["past_key_values.0.key"]).all()


# -- bounded deny outputs (rules/onnx.toml [bounded_output]) on the rotary decoders ---------

def _kv_cast_sources(model: onnx.ModelProto) -> dict[str, str]:
    """fp16 Cast → the op producing what it reads, for the casts that feed the K/V path."""
    producer = {o: n for n in model.graph.node for o in n.output}
    sources = {}
    for n in model.graph.node:
        to = next((a.i for a in n.attribute if a.name == "to"), None)
        if n.op_type == "Cast" and to == onnx.TensorProto.FLOAT16 and n.input[0] in producer:
            sources[n.input[0]] = producer[n.input[0]].op_type
    return sources


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-decode", "qwen2-decode"])
def test_bounded_cos_sin_cast_kv_before_head_repeat(name, monkeypatch):
    """With Cos/Sin's output bounded the rotary runs fp16, the cache is cast at the
    GroupQueryAttention's cache I/O (no head repeat is left to cast after), the angles stay
    fp32, and cast traffic falls."""
    path = decoders.cached_decoder(name)
    feeds = decoders.inputs(name)
    model = deployed.convert_ours(path)
    sources = _kv_cast_sources(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    present = {f"present.{i}.{kv}" for i in range(decoders.LAYERS) for kv in ("key", "value")}
    # fp16 present from GQA, cast up once to the fp32 graph output
    assert {producer[producer[p].input[0]].op_type for p in present} == {"GroupQueryAttention"}
    cast_inputs = {n.input[0] for n in model.graph.node if n.op_type == "Cast"}
    assert {f"past_key_values.{p[len('present.'):]}" for p in present} <= cast_inputs
    assert not {"Expand", "Reshape"} & set(sources.values()), sources
    assert {"Cos", "Sin"} <= set(sources.values())  # bounded outputs cast once each
    dtypes = {o: t for n, ts in deployed.node_dtypes(model) for o, t in zip(n.output, ts)}
    producer = {o: n for n in model.graph.node for o in n.output}
    cos = next(n for n in model.graph.node if n.op_type == "Cos")
    rows = producer[cos.input[0]]  # the RoPE cache's rows: Reshape(angles, (-1, E))
    angle = producer[rows.input[0]]  # position · inv_freq
    assert (rows.op_type, angle.op_type) == ("Reshape", "Mul")
    for node in (cos, rows, angle):
        assert dtypes[node.output[0]] == onnx.TensorProto.FLOAT, node.op_type
    low, total = deployed.low_share(model)
    monkeypatch.setenv("AMP_REWRITE_BOUNDED_OUTPUT_REMOVE", "Sin,Cos")
    unbounded = deployed.convert_ours(path)
    old_low, _ = deployed.low_share(unbounded)
    assert low > old_low and low / total >= 0.75, (low, old_low, total)
    casts, cast_bytes = deployed.cast_traffic(model, feeds)
    old_casts, old_bytes = deployed.cast_traffic(unbounded, feeds)
    assert casts <= old_casts and cast_bytes <= old_bytes, (casts, cast_bytes, old_bytes)


def test_shapeless_movement_output_costs_its_input():
    """A Transpose output without a shape (as fusions leave them) is as large as its input,
    so the view does not price a cast after a head repeat at one unit."""
    import onnx_ir as ir

    from amp_rewrite.core import LowDtype
    from amp_rewrite.onnx.view import build_view

    model = ir.from_proto(onnx.parser.parse_model("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[2, 4, 8, 16] x) => (float[2, 4, 16, 8] z) {
        y = Transpose <perm = [0, 1, 3, 2]> (x)
        z = Relu(y)
    }"""))
    y = next(n for n in model.graph if n.op_type == "Transpose").outputs[0]
    y.dtype, y.shape = ir.DataType.FLOAT, None
    view = build_view(model, LowDtype.FLOAT16)
    assert view.graph.value(y).nbytes == 2 * 4 * 8 * 16 * 4


# -- RoPE → com.microsoft::RotaryEmbedding (fusion/decoding.py) ------------------------------

def _rope_independent(x, cos, sin, interleaved):
    """RoPE as transformers writes it (torch, float64): x·cos + rotate(x)·sin with full-width
    tables; ``cos``/``sin`` are (B, S, rotary/2), ``x`` (B, N, S, H)."""
    import torch

    x, cos, sin = (torch.from_numpy(np.asarray(a, np.float64)) for a in (x, cos, sin))
    rotary = 2 * cos.shape[-1]
    xr, rest = x[..., :rotary], x[..., rotary:]
    if interleaved:
        cos_f = cos.repeat_interleave(2, dim=-1)[:, None]
        sin_f = sin.repeat_interleave(2, dim=-1)[:, None]
        rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    else:
        cos_f, sin_f = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
        half = rotary // 2
        rot = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    return torch.cat((xr * cos_f + rot * sin_f, rest), dim=-1).numpy()


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("layout", ["bnsh", "bsd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("partial", [False, True])
def test_rotary_reference_kernel_matches_independent_rope_and_ort(interleaved, layout, dtype,
                                                                  partial):
    import onnxruntime as ort
    from onnx import helper

    from amp_rewrite.onnx.validate import reference_evaluator

    b, n, s, h, max_pos = 2, 3, 5, 16, 40
    rotary = 8 if partial else h
    rng = np.random.default_rng(1)
    x = rng.standard_normal((b, n, s, h)).astype(dtype)
    pos = rng.integers(0, max_pos, (b, s)).astype(np.int64)
    angles = (np.arange(max_pos)[:, None] * 10000.0 ** (-np.arange(rotary // 2) / (rotary // 2)))
    cos_cache, sin_cache = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    expect = _rope_independent(x, cos_cache[pos], sin_cache[pos], interleaved)
    feed_x = x if layout == "bnsh" else x.transpose(0, 2, 1, 3).reshape(b, s, n * h)
    if layout == "bsd":
        expect = expect.transpose(0, 2, 1, 3).reshape(b, s, n * h)
    attrs = {"interleaved": interleaved}
    if partial:
        attrs.update(rotary_embedding_dim=rotary, num_heads=n)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"],
                            domain="com.microsoft", **attrs)
    graph = helper.make_graph(
        [node], "rope",
        [helper.make_tensor_value_info("x", elem, feed_x.shape),
         helper.make_tensor_value_info("pos", onnx.TensorProto.INT64, pos.shape),
         helper.make_tensor_value_info("cos", elem, cos_cache.shape),
         helper.make_tensor_value_info("sin", elem, sin_cache.shape)],
        [helper.make_tensor_value_info("y", elem, feed_x.shape)])
    model = helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    feeds = {"x": feed_x, "pos": pos, "cos": cos_cache, "sin": sin_cache}
    got = reference_evaluator(model).run(None, feeds)[0]
    assert got.dtype == dtype
    tol = 1e-6 if dtype == np.float32 else 2e-3  # fp16: one rounding of |y| <= ~4
    np.testing.assert_allclose(got.astype(np.float64), expect, rtol=0, atol=tol * 4)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ort_y = session.run(None, feeds)[0]
    np.testing.assert_allclose(got.astype(np.float64), ort_y.astype(np.float64), rtol=0,
                               atol=tol * 4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-decode", "llama-prefill", "qwen2-decode",
                                  "qwen2-prefill"])
def test_rope_fuses_to_rotary_embedding_with_fp32_angles(name):
    """Every layer's Q and K rotation becomes com.microsoft::RotaryEmbedding (2 layers × Q, K)
    reading one shared per-token cache whose angles and Cos/Sin stay fp32."""
    from amp_rewrite.onnx.api import rewrite_onnx_model

    result = rewrite_onnx_model(decoders.cached_decoder(name))
    fused = result.report["fused"]
    assert fused.get("com.microsoft::RotaryEmbedding") == 2 * decoders.LAYERS, fused
    assert fused.get("com.microsoft::GroupQueryAttention") == decoders.LAYERS, fused
    assert result.report["fusion_rules"].get("amp_rewrite.rotary_embedding") == 4
    model = result.model
    ropes = [n for n in model.graph if n.op_type == "RotaryEmbedding"]
    assert len(ropes) == 2 * decoders.LAYERS and {n.domain for n in ropes} == {"com.microsoft"}
    assert len({id(n.inputs[2]) for n in ropes}) == 1  # one cos cache for all of them
    assert sum(n.op_type == "Cos" for n in model.graph) == 1
    cos = next(n for n in model.graph if n.op_type == "Cos")
    assert cos.outputs[0].dtype.name == "FLOAT" and cos.inputs[0].dtype.name == "FLOAT"
    assert {n.inputs[0].dtype.name for n in ropes} == {"FLOAT16"}
    assert not any(n.op_type == "Neg" for n in model.graph)  # no rotate_half left


# -- GQA attention → com.microsoft::GroupQueryAttention (fusion/decoding.py) -----------------

GQA_NAMES = ["llama-decode", "llama-prefill", "qwen2-decode", "qwen2-prefill"]


def _gqa_independent(q, k, v, past_k, past_v, lengths, group, scale, key_mask=None):
    """Causal GQA in torch float64 from the definition: query row s of batch b (past p_b =
    lengths[b] − S, 0 on a prompt) sees keys [0, p_b + s + 1) of concat(past[:p_b], new),
    those where ``key_mask[b]`` (B, T) is true; query head n reads KV head n // group.
    q (B, N, S, H), k/v (B, Nkv, S, H)."""
    import torch

    t = lambda a: torch.from_numpy(np.asarray(a, np.float64))  # noqa: E731
    q, k, v = t(q), t(k), t(v)
    b, n, s, _ = q.shape
    out = torch.zeros_like(q)
    for i in range(b):
        p = 0 if past_k is None else int(lengths[i]) - s
        keys = k[i] if past_k is None else torch.cat((t(past_k)[i, :, :p], k[i]), dim=1)
        vals = v[i] if past_v is None else torch.cat((t(past_v)[i, :, :p], v[i]), dim=1)
        keys, vals = keys.repeat_interleave(group, 0), vals.repeat_interleave(group, 0)
        allowed = torch.arange(keys.shape[1])[None, :] <= (p + torch.arange(s))[:, None]
        if key_mask is not None:
            allowed = allowed & torch.from_numpy(key_mask[i, :keys.shape[1]])[None, :]
        out[i] = torch.nn.functional.scaled_dot_product_attention(
            q[i], keys, vals, attn_mask=allowed, scale=scale)
    return out.numpy()


def _gqa_model(elem, b, s, n, nkv, h, past, scale, bias=False):
    from onnx import helper

    inputs = [helper.make_tensor_value_info("q", elem, [b, s, n * h]),
              helper.make_tensor_value_info("k", elem, [b, s, nkv * h]),
              helper.make_tensor_value_info("v", elem, [b, s, nkv * h])]
    names = ["q", "k", "v", "", "", "seqlens_k", "total"]
    if past:
        inputs += [helper.make_tensor_value_info(x, elem, [b, nkv, past, h]) for x in ("pk", "pv")]
        names[3:5] = ["pk", "pv"]
    inputs += [helper.make_tensor_value_info("seqlens_k", onnx.TensorProto.INT32, [b]),
               helper.make_tensor_value_info("total", onnx.TensorProto.INT32, [])]
    if bias:
        inputs.append(helper.make_tensor_value_info("bias", elem, [b, 1, s, past + s]))
        names += ["", "", "", "bias"]
    node = helper.make_node("GroupQueryAttention", names, ["y", "present_k", "present_v"],
                            domain="com.microsoft", num_heads=n, kv_num_heads=nkv, scale=scale)
    outputs = [helper.make_tensor_value_info("y", elem, None),
               helper.make_tensor_value_info("present_k", elem, None),
               helper.make_tensor_value_info("present_v", elem, None)]
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    return helper.make_model(graph, ir_version=9, opset_imports=[
        helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("step", ["decode", "prefill", "prefill-right-padded",
                                  "prefill-left-padded", "decode-left-padded"])
def test_gqa_reference_kernel_matches_independent_gqa_and_ort(dtype, step):
    """Right padding by seqlens_k alone; left padding as the fusion writes it: seqlens_k =
    T − 1 on every row and the padding as attention_bias (float16's lowest where masked)."""
    import onnxruntime as ort

    from amp_rewrite.onnx.validate import reference_evaluator

    b, n, nkv, h, scale = 2, 4, 2, 16, 0.3
    rng = np.random.default_rng(3)
    past = 7 if step == "decode" else 0
    s = 1 if step == "decode" else 6
    total = past + s
    left = step.endswith("left-padded")
    lengths = np.array([total, total - 2 if step.endswith("right-padded") else total])
    q = rng.standard_normal((b, n, s, h)).astype(dtype)
    k = rng.standard_normal((b, nkv, s, h)).astype(dtype)
    v = rng.standard_normal((b, nkv, s, h)).astype(dtype)
    bsd = lambda x: x.transpose(0, 2, 1, 3).reshape(b, s, -1)  # noqa: E731
    feeds = {"q": bsd(q), "k": bsd(k), "v": bsd(v), "seqlens_k": (lengths - 1).astype(np.int32),
             "total": np.array(total, np.int32)}
    key_mask = None
    if left:  # row 1: its first 3 keys are padding
        key_mask = np.ones((b, total), bool)
        key_mask[1, :3] = False
        feeds["bias"] = np.broadcast_to(np.where(key_mask, 0, -65504)[:, None, None, :],
                                        (b, 1, s, total)).astype(dtype)
    past_k = past_v = None
    if past:
        past_k = rng.standard_normal((b, nkv, past, h)).astype(dtype)
        past_v = rng.standard_normal((b, nkv, past, h)).astype(dtype)
        feeds.update(pk=past_k, pv=past_v)
    model = _gqa_model(helper_elem(dtype), b, s, n, nkv, h, past, scale, bias=left)
    expect = _gqa_independent(q, k, v, past_k, past_v, lengths, n // nkv, scale, key_mask)
    expect = expect.transpose(0, 2, 1, 3).reshape(b, s, n * h)
    got = reference_evaluator(model).run(None, feeds)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ort_out = session.run(None, feeds)
    assert got[0].dtype == dtype and got[1].shape == ort_out[1].shape
    tol = 1e-6 if dtype == np.float32 else 2e-3
    # padded query rows are undefined: right padding's last ones, left padding's first ones
    rows = [(i, slice(3 if left and i and not past else 0, int(lengths[i]) - past))
            for i in range(b)]
    for i, valid in rows:
        np.testing.assert_allclose(got[0][i, valid].astype(np.float64), expect[i, valid],
                                   rtol=0, atol=tol)
        np.testing.assert_allclose(got[0][i, valid].astype(np.float64),
                                   ort_out[0][i, valid].astype(np.float64), rtol=0, atol=tol)
    for mine, theirs in zip(got[1:], ort_out[1:]):  # present: bit-exact copies
        np.testing.assert_array_equal(mine, theirs)
    if past:
        np.testing.assert_array_equal(got[1][:, :, :past], past_k)
        np.testing.assert_array_equal(got[1][:, :, past:], k)


def helper_elem(dtype) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


@pytest.mark.slow
@pytest.mark.parametrize("name", GQA_NAMES)
def test_gqa_decoders_fuse_to_group_query_attention(name):
    """Both layers' attention (cache Concat, repeat_kv, SDPA, causal ∧ padding mask) become
    GroupQueryAttention: no head repeat left, the decode step's present.* come from it."""
    from amp_rewrite.onnx.api import rewrite_onnx_model

    result = rewrite_onnx_model(decoders.cached_decoder(name))
    fused = result.report["fused"]
    assert fused.get("com.microsoft::GroupQueryAttention") == decoders.LAYERS, fused
    assert "com.microsoft::MultiHeadAttention" not in fused, fused
    rules = result.report["fusion_rules"]
    step = "amp_rewrite.group_query_attention" + ("" if name.endswith("decode") else ".prompt")
    assert rules.get(step) == 2, rules
    model = result.model
    ops = [n.op_type for n in model.graph]
    assert "Softmax" not in ops, ops
    # no head repeat left (the Expands left build the padding mask's indices and seqlens_k)
    assert {n.outputs[0].dtype.name for n in model.graph if n.op_type == "Expand"} <= {
        "INT32", "INT64"}
    gqas = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    for node in gqas:
        attrs = {k: v.value for k, v in node.attributes.items()}
        assert attrs == {"num_heads": 4, "kv_num_heads": 2, "scale": 0.25, "do_rotary": 0}
    if decoders.spec(name).has_past:
        assert "Concat" not in {n.op_type for n in model.graph
                                if n.outputs[0].dtype is not None and n.outputs[0].dtype.name
                                in ("FLOAT", "FLOAT16")}
        readers = {n.inputs[3].name for n in gqas} | {n.inputs[4].name for n in gqas}
        assert len(readers) == 2 * decoders.LAYERS


def _padded(name: str, side: str) -> dict[str, np.ndarray]:
    """Batch of 2 whose second row has 5 padding tokens, at the end (right) or at the start
    (left, transformers' padding for generation; positions then count from the first real
    token). A decode step's padding is in its past of 12."""
    feeds = decoders.inputs(name, batch=2, past=12)
    mask = feeds["attention_mask"]
    pad = 5
    if side == "right":
        mask[1, -pad:] = 0
    else:
        mask[1, :pad] = 0
        feeds["position_ids"][1] = np.maximum(
            np.arange(mask.shape[1] - feeds["position_ids"].shape[1], mask.shape[1]) - pad, 0)
    return feeds


@pytest.mark.slow
@pytest.mark.parametrize("name, side", [("llama-prefill", "right"), ("llama-prefill", "left"),
                                        ("qwen2-prefill", "left"), ("llama-decode", "left")])
def test_gqa_exact_for_padding_on_either_side(name, side):
    """The fused GroupQueryAttention gets seqlens_k = T − 1 on every row and the padding as
    attention_bias, so a padded batch is exact on its valid query rows and the present
    cache's valid positions (fp16 rewrite vs the FP32 export, ORT), whichever side the
    padding is on, and finite everywhere."""
    import onnx_ir as ir

    from amp_rewrite.onnx.api import rewrite_onnx_model

    path = decoders.cached_decoder(name)
    result = rewrite_onnx_model(path)
    assert result.report["fused"].get("com.microsoft::GroupQueryAttention") == decoders.LAYERS
    model = ir.to_proto(result.model)
    feeds = _padded(name, side)
    ref = deployed.run_ort(onnx.load(str(path)), feeds)  # the FP32 export
    got = deployed.run_ort(model, feeds)
    new = feeds["input_ids"].shape[1]
    valid = slice(0, new - 5) if side == "right" else slice(5 if new > 1 else 0, new)
    assert deployed.relative_error([got[0][1, valid]], [ref[0][1, valid]]) <= TOLERANCE
    assert deployed.relative_error([got[0][0]], [ref[0][0]]) <= TOLERANCE
    # present: every row of the unpadded sequence, the padded one's valid positions (after
    # the first layer, K/V at padding derive from padded query rows, which are undefined)
    keys = feeds["attention_mask"][1].astype(bool)
    assert deployed.relative_error([p[0] for p in got[1:]], [p[0] for p in ref[1:]]) <= TOLERANCE
    assert deployed.relative_error([p[1][:, keys] for p in got[1:]],
                                   [p[1][:, keys] for p in ref[1:]]) <= TOLERANCE
    assert all(np.isfinite(out).all() for out in got)


@pytest.mark.slow
@pytest.mark.parametrize("mutation", ["strict_causal", "weak_fill", "no_padding"])
def test_gqa_declines_unproven_masks_and_mha_runs(mutation):
    import onnx_ir as ir

    from amp_rewrite.onnx.api import rewrite_onnx_model

    model = ir.load(str(decoders.cached_decoder("llama-decode")))
    if mutation == "strict_causal":
        node = next(n for n in model.graph if n.op_type == "LessOrEqual")
        node.op_type = "Less"
    elif mutation == "weak_fill":
        where = next(n for n in model.graph if n.op_type == "Where"
                     and n.inputs[0].producer() is not None
                     and n.inputs[0].producer().op_type == "And")
        where.replace_input_with(2, ir.Value(name="fill", const_value=ir.tensor(
            np.array(-100.0, np.float32))))
        model.graph.initializers["fill"] = where.inputs[2]
    else:
        gather = next(n for n in model.graph if n.op_type == "GatherND")
        outer = next(u.node for u in gather.outputs[0].uses() if u.node.op_type == "And")
        outer.replace_input_with(1, outer.inputs[0])
    result = rewrite_onnx_model(model)
    fused = result.report["fused"]
    assert "com.microsoft::GroupQueryAttention" not in fused, fused
    assert fused.get("com.microsoft::MultiHeadAttention") == decoders.LAYERS, fused


# -- --target onnx at opset 23: ONNX RotaryEmbedding + Attention-23 with the KV cache ---------
#
# onnxruntime 1.31's CPU provider runs opset-23 Attention (boolean mask, past/present, GQA
# head counts, softmax_precision) and RotaryEmbedding in fp32 and fp16; in bf16 it has no
# kernel (the Attention function body's Expand has no bf16 CPU kernel), so bf16 is checked
# in onnx.reference only, as everywhere in this file.


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


def _assert_onnx_kv_attention(model: onnx.ModelProto, name: str) -> None:
    """Both layers: 4 standard RotaryEmbedding, 2 standard Attention reading the new K/V (no
    head repeat) and, on a decode step, the cache inputs, writing present.*; no contrib op."""
    nodes = model.graph.node
    assert {n.domain for n in nodes} <= {"", "ai.onnx"}, {n.domain for n in nodes}
    assert sum(n.op_type == "RotaryEmbedding" for n in nodes) == 2 * decoders.LAYERS
    attention = [n for n in nodes if n.op_type == "Attention"]
    assert len(attention) == decoders.LAYERS
    producer = _producers(model)
    for node in attention:
        for kv in node.input[1:3]:  # the new K/V: no Reshape(Expand(Unsqueeze)) head repeat
            assert producer[kv].op_type not in ("Reshape", "Expand"), producer[kv].op_type
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs.get("is_causal", 0) == 0 and attrs["softmax_precision"] == 1, attrs
        assert "q_num_heads" not in attrs  # 4-D: GQA from the shapes (4 query, 2 KV heads)
        if decoders.spec(name).has_past:
            assert len(node.input) == 6
            pasts = [producer[v].input[0] if v in producer else v for v in node.input[4:6]]
            assert all(p.startswith("past_key_values.") for p in pasts), pasts
    if decoders.spec(name).has_past:  # present.* come from the Attention (cast up)
        for out in decoders.output_names(name)[1:]:
            node = producer[out]
            node = producer[node.input[0]] if node.op_type == "Cast" else node
            assert node.op_type == "Attention", (out, node.op_type)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", GQA_NAMES)
def test_target_onnx_opset23_decoders_fuse_kv_cache_attention(name, dtype, tmp_path, capsys):
    """The opset-23 export (its RotaryEmbedding and Attention are the exporter's) rewritten
    with --target onnx: the Attention takes the KV cache, within tolerance of torch fp32 at a
    4- and a 1,000-token past (onnx.reference; ORT CPU for fp16)."""
    out = tmp_path / "out.onnx"
    path = decoders.cached_decoder(name, opset=23)
    args = [str(path), "-o", str(out), "--dtype", dtype, "--target", "onnx", "-q"]
    assert main(args) == 0, capsys.readouterr()
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    _assert_onnx_kv_attention(model, name)
    pasts = [decoders.PAST, LONG_PAST] if decoders.spec(name).has_past else [0]
    for past in pasts:
        error = _error_vs_torch(model, name, deployed.run_reference, past)
        assert error <= TOLERANCES[dtype], (past, error)
    if dtype == "fp16":
        assert _error_vs_torch(model, name, deployed.run_ort, pasts[-1]) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-decode", "qwen2-prefill"])
def test_target_onnx_converted_opset18_decoder_fuses_rope_and_attention(name):
    """The opset-18 export brought to 23 by the version converter has the plain chains: the
    shared rotary matcher writes ONNX RotaryEmbedding with one fp32 Cos/Sin pair of the
    angles (cast once), SDPA → Attention, then the KV-cache fold."""
    import onnx_ir as ir

    from amp_rewrite.onnx.api import rewrite_onnx_model

    result = rewrite_onnx_model(decoders.cached_decoder(name), opset=23, target="onnx")
    fused = result.report["fused"]
    assert fused.get("RotaryEmbedding") == 2 * decoders.LAYERS, fused
    assert fused.get("Attention") == decoders.LAYERS, fused
    hits = result.report["fusion_rules"]
    assert hits.get("amp_rewrite.rotary_embedding") == 2 * decoders.LAYERS, hits
    step = "amp_rewrite.attention_kv_cache" + ("" if name.endswith("decode") else ".prompt")
    assert hits.get(step) == decoders.LAYERS, hits
    graph = result.model.graph
    assert sum(n.op_type == "Cos" for n in graph) == 1 == sum(n.op_type == "Sin" for n in graph)
    cos = next(n for n in graph if n.op_type == "Cos")
    assert cos.outputs[0].dtype.name == "FLOAT" and cos.inputs[0].dtype.name == "FLOAT"
    assert not any(n.op_type in ("Neg", "Softmax") for n in graph)
    model = ir.to_proto(result.model)
    onnx.checker.check_model(model, full_check=True)
    _assert_onnx_kv_attention(model, name)
    past = LONG_PAST if decoders.spec(name).has_past else 0
    for run in (deployed.run_reference, deployed.run_ort):
        assert _error_vs_torch(model, name, run, past) <= TOLERANCE


@pytest.mark.slow
def test_target_onnx_attention_carries_the_mask_left_padding_exact():
    """The mask travels into Attention-23 unchanged (no seqlens): a left-padded prompt batch
    stays exact on every valid row, where GroupQueryAttention's contract breaks."""
    import onnx_ir as ir

    from amp_rewrite.onnx.api import rewrite_onnx_model

    name = "llama-prefill"
    result = rewrite_onnx_model(decoders.cached_decoder(name, opset=23), target="onnx")
    assert result.report["fused"].get("Attention") == decoders.LAYERS
    model = ir.to_proto(result.model)
    feeds = _padded(name, "left")
    ref = decoders.torch_reference(name, feeds)
    for run in (deployed.run_reference, deployed.run_ort):
        got = run(model, feeds)
        assert deployed.relative_error([got[0][1, 5:]], [ref[0][1, 5:]]) <= TOLERANCE
        assert deployed.relative_error([got[0][0]], [ref[0][0]]) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("mutation", ["is_causal", "repeat_axis"])
def test_target_onnx_attention_declines_and_the_plain_attention_stays(mutation):
    import onnx_ir as ir

    from amp_rewrite.onnx.api import rewrite_onnx_model

    model = ir.load(str(decoders.cached_decoder("llama-decode", opset=23)))
    attention = [n for n in model.graph if n.op_type == "Attention"]
    if mutation == "is_causal":  # with a past, ONNX's causal frontier would move
        for node in attention:
            node.attributes["is_causal"] = ir.AttrInt64("is_causal", 1)
    else:  # repeat on another axis: not repeat_kv's grouping
        for node in attention:
            unsq = node.inputs[1].producer().inputs[0].producer().inputs[0].producer()
            axes = ir.Value(name=f"axes_{node.name}", const_value=ir.tensor(np.array([1])))
            model.graph.initializers[axes.name] = axes
            unsq.replace_input_with(1, axes)
    result = rewrite_onnx_model(model, target="onnx", check=False)
    assert "Attention" not in result.report["fused"], result.report["fused"]
    attention = [n for n in result.model.graph if n.op_type == "Attention"]
    assert len(attention) == decoders.LAYERS
    assert all(len(n.inputs) == 4 and n.inputs[1].producer().op_type == "Reshape"
               for n in attention)


@pytest.mark.slow
def test_gqa_fuses_every_layer_of_a_deeper_decoder(tmp_path, monkeypatch):
    """At 8 layers the exporter reads the batch size off a cache input instead of
    attention_mask (the same symbolic dim): every layer still fuses, and the decode step
    stays within fp16 tolerance of PyTorch FP32."""
    import onnxruntime as ort

    from amp_rewrite.onnx import rewrite_onnx

    monkeypatch.setattr(decoders, "LAYERS", 8)
    path = decoders.export("llama-decode", tmp_path / "llama-decode-8.onnx")
    mixed = rewrite_onnx(path)
    assert sum(n.op_type == "GroupQueryAttention" for n in mixed.graph.node) == 8
    feeds = decoders.inputs("llama-decode")
    session = ort.InferenceSession(mixed.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)
    for ours, want in zip(got, decoders.torch_reference("llama-decode", feeds)):
        assert np.abs(ours.astype(np.float32) - want).max() <= 1e-2 * np.abs(want).max()
