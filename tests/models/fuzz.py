"""Seeded mutations of ONNX models, to check the CLI's promise on bad input: a documented
exit code and one line, never an internal error (exit 1) or a traceback.

Each mutation damages one thing a real file can get wrong: a field's bytes, a type, a
dim, a name, an attribute, the node order, the header, the raw bytes of the file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

INVALID_UTF8 = (b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80")
STRING_MARKER = "FUZZSTRINGMARKER"


def seed_models() -> dict[str, onnx.ModelProto]:
    """Small valid models with different features: GEMM chain with a norm, an If with
    captured values, a model-local function, a Conv, dynamic dims, a Loop with a scan
    output."""
    T = onnx.TensorProto
    rng = np.random.default_rng(0)
    w = onh.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    b = onh.from_array(rng.standard_normal(8).astype(np.float32), "b")
    mlp = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                         oh.make_node("Add", ["h", "b"], ["h2"], name="add"),
                         oh.make_node("Softmax", ["h2"], ["s"], name="sm", axis=-1),
                         oh.make_node("Cast", ["s"], ["y"], name="cast", to=T.FLOAT)],
                        "mlp", [oh.make_tensor_value_info("x", T.FLOAT, ["batch", 8])],
                        [oh.make_tensor_value_info("y", T.FLOAT, ["batch", 8])], [w, b])
    then_g = oh.make_graph([oh.make_node("MatMul", ["h", "w"], ["o1"])], "then", [],
                           [oh.make_tensor_value_info("o1", T.FLOAT, [2, 8])])
    else_g = oh.make_graph([oh.make_node("Relu", ["h"], ["o2"])], "else", [],
                           [oh.make_tensor_value_info("o2", T.FLOAT, [2, 8])])
    branchy = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                             oh.make_node("If", ["c"], ["y"], name="if", then_branch=then_g,
                                          else_branch=else_g)],
                            "branchy", [oh.make_tensor_value_info("x", T.FLOAT, [2, 8]),
                                        oh.make_tensor_value_info("c", T.BOOL, [])],
                            [oh.make_tensor_value_info("y", T.FLOAT, [2, 8])], [w])
    fn = oh.make_function("local", "Gelu2", ["a"], ["o"],
                          [oh.make_node("Tanh", ["a"], ["t"]),
                           oh.make_node("Mul", ["a", "t"], ["o"])],
                          [oh.make_opsetid("", 18)])
    func = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                          oh.make_node("Gelu2", ["h"], ["y"], domain="local", name="g")],
                         "func", [oh.make_tensor_value_info("x", T.FLOAT, [2, 8])],
                         [oh.make_tensor_value_info("y", T.FLOAT, [2, 8])], [w])
    k = onh.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "k")
    conv = oh.make_graph([oh.make_node("Conv", ["x", "k"], ["c"], name="conv", pads=[1, 1, 1, 1]),
                          oh.make_node("Relu", ["c"], ["r"], name="relu"),
                          oh.make_node("ReduceMean", ["r"], ["y"], name="mean", keepdims=1)],
                         "conv", [oh.make_tensor_value_info("x", T.FLOAT, [1, 3, 8, 8])],
                         [oh.make_tensor_value_info("y", T.FLOAT, [1, 1, 1, 1])], [k])
    body = oh.make_graph([oh.make_node("MatMul", ["acc_in", "w"], ["mm"]),
                          oh.make_node("Tanh", ["mm"], ["acc_out"]),
                          oh.make_node("Identity", ["acc_out"], ["step"]),
                          oh.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
                         [oh.make_tensor_value_info("i", T.INT64, []),
                          oh.make_tensor_value_info("cond_in", T.BOOL, []),
                          oh.make_tensor_value_info("acc_in", T.FLOAT, [2, 8])],
                         [oh.make_tensor_value_info("cond_out", T.BOOL, []),
                          oh.make_tensor_value_info("acc_out", T.FLOAT, [2, 8]),
                          oh.make_tensor_value_info("step", T.FLOAT, [2, 8])])
    # random inputs give a trip count of 0 or 1: a Loop that may not run at all
    loop = oh.make_graph([oh.make_node("Loop", ["n", "go", "x"], ["acc", "steps"], name="loop",
                                       body=body)],
                         "loop", [oh.make_tensor_value_info("x", T.FLOAT, [2, 8]),
                                  oh.make_tensor_value_info("n", T.INT64, [])],
                         [oh.make_tensor_value_info("acc", T.FLOAT, [2, 8]),
                          oh.make_tensor_value_info("steps", T.FLOAT, [None, 2, 8])],
                         [w, onh.from_array(np.array(True), "go")])
    models = {}
    for name, graph, extra in (("mlp", mlp, []), ("branchy", branchy, []),
                               ("func", func, [oh.make_opsetid("local", 1)]), ("conv", conv, []),
                               ("loop", loop, [])):
        m = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), *extra],
                          functions=[fn] if name == "func" else [])
        m.ir_version = 9
        m.producer_name = "fuzz"
        onnx.checker.check_model(m, full_check=True)
        models[name] = m
    return models


# The zoo's families as people deploy them: SDPA attention with dynamic axes, an image
# model, a UNet stage, encoder-decoders and KV-cache decoder steps (``zoo.cached_onnx`` and
# ``decoders.cached_decoder`` keyword arguments, or a decoder's name).
ZOO_SEEDS: dict[str, dict | str] = {
    "bert-sdpa-dynamic": {"name": "bert", "attn_implementation": "sdpa", "dynamic": True},
    "llama-sdpa-dynamic": {"name": "llama", "attn_implementation": "sdpa", "dynamic": True},
    "vit-sdpa-dynamic": {"name": "vit", "attn_implementation": "sdpa", "dynamic": True},
    "unet_block-sdpa-dynamic": {"name": "unet_block", "attn_implementation": "sdpa",
                                "dynamic": True},
    "t5": {"name": "t5"},
    "bart": {"name": "bart"},
    "llama-decode": "llama-decode",
    "whisper-decode": "whisper-decode",
}


def zoo_seed_models(names: list[str] | None = None) -> dict[str, onnx.ModelProto]:
    """The ``ZOO_SEEDS`` models (exported on first use, then cached)."""
    from tests.models import decoders, zoo

    models = {}
    for name in names or sorted(ZOO_SEEDS):
        how = ZOO_SEEDS[name]
        path = (decoders.cached_decoder(how) if isinstance(how, str)
                else zoo.cached_onnx(how["name"], **{k: v for k, v in how.items() if k != "name"}))
        models[name] = onnx.load(path)
    return models


Mutation = Callable[[onnx.ModelProto, random.Random], None]


def _strings(m: onnx.ModelProto, r: random.Random) -> None:
    field = r.choice(["graph_name", "producer", "doc", "node_name", "metadata", "value_name"])
    if field == "graph_name":
        m.graph.name = STRING_MARKER
    elif field == "producer":
        m.producer_name = STRING_MARKER
    elif field == "doc":
        m.graph.doc_string = STRING_MARKER
    elif field == "node_name":
        r.choice(m.graph.node).name = STRING_MARKER
    elif field == "metadata":
        oh.set_model_props(m, {"k": STRING_MARKER})
    else:
        _rename_value(m, r, STRING_MARKER)


def _rename_value(m: onnx.ModelProto, r: random.Random, new: str) -> None:
    node = r.choice(m.graph.node)
    old = node.output[0]
    for n in m.graph.node:
        n.input[:] = [new if i == old else i for i in n.input]
        n.output[:] = [new if o == old else o for o in n.output]
    for o in m.graph.output:
        if o.name == old:
            o.name = new


def _elem_type(m, r):
    targets = [*m.graph.initializer] or [None]
    t = r.choice(targets)
    value = r.choice([0, 7, 8, 16, 17, 23, 25, 30, 77, 999])
    if t is not None and r.random() < 0.6:
        t.data_type = value
    else:
        r.choice([*m.graph.input, *m.graph.output]).type.tensor_type.elem_type = value


def _raw_data(m, r):
    if not m.graph.initializer:
        return
    t = r.choice(m.graph.initializer)
    data = bytes(t.raw_data) if t.raw_data else onh.to_array(t).tobytes()
    t.ClearField("float_data")
    delta = r.choice([-3, -1, 1, 2, 5, -len(data)])
    t.raw_data = data[:delta] if delta < 0 else data + b"\0" * delta


def _dims(m, r):
    vi = r.choice([*m.graph.input, *m.graph.output])
    dims = vi.type.tensor_type.shape.dim
    if not dims:
        return
    d = r.choice(dims)
    d.Clear()
    d.dim_value = r.choice([0, 1, 3, 10**6, 10**11]) if r.random() < 0.8 else 1
    if r.random() < 0.2:
        d.dim_param = "n"


def _op_type(m, r):
    n = r.choice(m.graph.node)
    n.op_type = r.choice(["Matmul", "Resize", "Slice", "Cast", "Scan", "Loop", "SequenceEmpty",
                          "Frobnicate", "Softmax", "Gemm", "If", ""])


def _node_inputs(m, r):
    n = r.choice(m.graph.node)
    choice = r.random()
    if choice < 0.3 and n.input:
        del n.input[-1]
    elif choice < 0.6:
        n.input.append(r.choice(["x", "w", "missing", ""]))
    else:
        n.input[:] = [r.choice(["x", "w", "missing", ""]) for _ in n.input]


def _attribute(m, r):
    n = r.choice(m.graph.node)
    name = r.choice(["to", "axis", "dtype", "pads", "keepdims", "then_branch", "bogus"])
    kind = r.random()
    for a in list(n.attribute):
        if a.name == name:
            n.attribute.remove(a)
    if name == "pads":
        pads = [r.randint(-2, 3) for _ in range(r.choice([1, 4]))]
        n.attribute.append(oh.make_attribute(name, pads))
    elif kind < 0.7:
        n.attribute.append(oh.make_attribute(name, r.choice([-5, -1, 0, 1, 2, 10, 99, 2**40])))
    else:
        n.attribute.append(oh.make_attribute(name, "text"))


def _graph_outputs(m, r):
    if r.random() < 0.5:
        m.graph.ClearField("output")
    else:
        m.graph.output.append(oh.make_tensor_value_info(r.choice(["x", "h", "ghost"]),
                                                        onnx.TensorProto.FLOAT, [2, 8]))


def _header(m, r):
    if r.random() < 0.5:
        m.ir_version = r.choice([0, 1, 3, 7, 11, 14, 99])
    else:
        m.opset_import[0].version = r.choice([1, 6, 11, 13, 22, 25, 99])


def _node_order(m, r):
    nodes = list(m.graph.node)
    if len(nodes) < 2:
        return
    if r.random() < 0.5:
        r.shuffle(nodes)
    else:
        nodes.append(nodes[0])
    m.graph.ClearField("node")
    m.graph.node.extend(nodes)


def _initializers(m, r):
    if m.graph.initializer and r.random() < 0.5:
        del m.graph.initializer[r.randrange(len(m.graph.initializer))]
    else:
        arr = np.full((8, 8), r.choice([1e8, 7e4, np.inf, np.nan, 1e-9]), np.float32)
        name = m.graph.initializer[0].name if m.graph.initializer else "w"
        for i, t in enumerate(m.graph.initializer):
            if t.name == name:
                m.graph.initializer[i].CopyFrom(onh.from_array(arr, name))


def _functions(m, r):
    if not m.functions:
        return _op_type(m, r)
    f = m.functions[0]
    choice = r.random()
    if choice < 0.4:
        f.node.append(oh.make_node(f.name, ["a"], ["o"], domain=f.domain))  # recursion
    elif choice < 0.7:
        for n in m.graph.node:
            if n.domain == f.domain:
                n.input.append("x")  # more actuals than formals
    else:
        m.ir_version = 7


def _insert_op(m, r):
    """A valid model still: one unary or binary float op spliced after a node."""
    n = r.choice([n for n in m.graph.node if n.op_type != "If"] or list(m.graph.node))
    old = n.output[0]
    new = f"{old}_pre"
    n.output[0] = new
    op = r.choice(["Relu", "Exp", "Sqrt", "Log", "Neg", "Tanh", "Sigmoid", "Reciprocal",
                   "Softmax", "LayerNormalization", "Add", "Div", "Pow", "ReduceSum", "Identity",
                   "Cast"])
    if op in ("Add", "Div", "Pow"):
        node = oh.make_node(op, [new, new], [old])
    elif op == "Cast":
        node = oh.make_node(op, [new], [old], to=onnx.TensorProto.FLOAT)
    elif op == "LayerNormalization":
        size = 8
        name = f"ln_scale_{len(m.graph.initializer)}"
        m.graph.initializer.append(onh.from_array(np.ones(size, np.float32), name))
        node = oh.make_node(op, [new, name], [old], axis=-1)
    elif op == "ReduceSum":
        node = oh.make_node(op, [new], [old], keepdims=1)
    else:
        node = oh.make_node(op, [new], [old])
    index = list(m.graph.node).index(n) + 1
    m.graph.node.insert(index, node)


def _valid_cast(m, r):
    """Casts to another real dtype: valid, and a trap for dtype bookkeeping."""
    for n in m.graph.node:
        if n.op_type == "Cast":
            n.attribute[0].i = r.choice([1, 10, 11, 16, 7, 6, 9])
            return
    _insert_op(m, r)


def _weird_names(m, r):
    """Valid but unusual names: unicode, spaces, slashes, names that look like ours."""
    _rename_value(m, r, r.choice(["ü/ñ 名前", "a b", "x_float16", "y", "amp_cast_y_f32", "::"]))
    r.choice(m.graph.node).name = r.choice(["", "mm", "§", "node/with/slashes"])


def _symbolic_dims(m, r):
    for vi in (*m.graph.input, *m.graph.output):
        for d in vi.type.tensor_type.shape.dim:
            if r.random() < 0.5:
                d.Clear()
                d.dim_param = r.choice(["n", "batch", "s"])


VALID_LOOKING: list[Mutation] = [_strings, _insert_op, _valid_cast, _weird_names,
                                 _symbolic_dims, _initializers]
STRUCTURED: list[Mutation] = [_strings, _elem_type, _raw_data, _dims, _op_type, _node_inputs,
                              _attribute, _graph_outputs, _header, _node_order, _initializers,
                              _functions]


def _bytes_mutation(data: bytes, r: random.Random) -> bytes:
    data = bytearray(data)
    choice = r.random()
    if choice < 0.4:
        for _ in range(r.randint(1, 8)):
            data[r.randrange(len(data))] = r.randrange(256)
    elif choice < 0.7:
        data = data[: r.randrange(1, len(data))]
    else:
        i = r.randrange(len(data))
        data[i:i] = bytes(r.randrange(256) for _ in range(r.randint(1, 16)))
    return bytes(data)


@dataclass
class Case:
    seed: int
    base: str
    mutations: list[str]
    data: bytes
    flags: list[str]
    calibration: dict[str, np.ndarray] | None = None
    # weights in a side file, and what goes wrong with it: "" (nothing), "offset",
    # "length", "truncated", "missing"; None: weights inline
    external: str | None = None


def make_case(seed: int, models: dict[str, onnx.ModelProto]) -> Case:
    r = random.Random(seed)
    base = r.choice(sorted(models))
    m = onnx.ModelProto()
    m.CopyFrom(models[base])
    names = []
    pool = VALID_LOOKING if r.random() < 0.4 else STRUCTURED + VALID_LOOKING
    for _ in range(r.choice([1, 1, 2, 3])):
        mutation = r.choice(pool)
        names.append(mutation.__name__.lstrip("_"))
        with contextlib.suppress(Exception):  # a mutation that does not apply is skipped
            mutation(m, r)
    data = m.SerializeToString()
    if STRING_MARKER.encode() in data:  # same length, so the protobuf framing stays intact
        bad = b"bad" + r.choice(INVALID_UTF8)
        data = data.replace(STRING_MARKER.encode(), bad.ljust(len(STRING_MARKER), b"x"))
    if r.random() < 0.15:
        data = _bytes_mutation(data, r)
        names.append("bytes")
    flags = r.choice([[], ["--validate"], ["--dtype", "bf16"], ["--no-keep-io-types", "--validate"],
                      ["--keep-fp32", "mm"], ["--calibrate"], ["--calibrate", "--validate"]])
    calibration = _calibration(models[base], r) if "--calibrate" in flags else None
    external = None
    if "bytes" not in names and r.random() < 0.25:
        external = r.choice(["", "", "", "offset", "length", "truncated", "missing"])
    return Case(seed, base, names, data, flags, calibration, external)


def with_dtype(case: Case, dtype: str | None) -> Case:
    """The case run with ``--dtype dtype`` in place of the dtype it drew (None: unchanged)."""
    if dtype is None:
        return case
    flags = list(case.flags)
    if "--dtype" in flags:
        del flags[flags.index("--dtype"):flags.index("--dtype") + 2]
    return dataclasses.replace(case, flags=[*flags, "--dtype", dtype])


def _write_model(case: Case, src: Path) -> None:
    """The case's bytes, or (``case.external``) the model with its weights in a side file,
    damaged as the case says."""
    if case.external is None:
        src.write_bytes(case.data)
        return
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(case.data)
        onnx.save(proto, src, save_as_external_data=True, location=src.name + ".data",
                  size_threshold=0)
    except Exception:  # noqa: BLE001 - a mutation the saver refuses: inline then
        src.write_bytes(case.data)
        return
    data = src.with_name(src.name + ".data")
    if case.external == "missing":
        data.unlink(missing_ok=True)
    elif case.external == "truncated" and data.exists():
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif case.external in ("offset", "length"):
        external = [t for t in proto.graph.initializer if t.external_data]
        if external:
            entry = external[0].external_data
            keys = [kv.key for kv in entry]
            if case.external not in keys:
                entry.add(key=case.external, value="0")
            for kv in entry:
                if kv.key == case.external:
                    kv.value = str(10**9)
            src.write_bytes(proto.SerializeToString())


def _calibration(model: onnx.ModelProto, r: random.Random) -> dict[str, np.ndarray]:
    """Inputs for the unmutated model, then maybe one defect: float64, a wrong rank, a
    missing or an unknown key."""
    from amp_rewrite.onnx.validate import random_feeds

    feeds = random_feeds(model)
    name = r.choice(sorted(feeds))
    defect = r.choice(["none", "none", "float64", "rank", "missing", "unknown", "int"])
    if defect == "float64":
        feeds[name] = feeds[name].astype(np.float64)
    elif defect == "rank":
        feeds[name] = feeds[name][None]
    elif defect == "missing":
        del feeds[name]
    elif defect == "unknown":
        feeds["not_an_input"] = np.zeros(3, np.float32)
    elif defect == "int":
        feeds[name] = np.zeros(feeds[name].shape, np.int32)
    return feeds


@dataclass
class Outcome:
    case: Case
    exit_code: int
    stderr: str
    input_changed: bool = False
    # the full ONNX check's error on an output whose input passes it, else None
    output_check_error: str | None = None

    @property
    def bad(self) -> bool:
        """An internal error (exit 1 or a message that says so), a traceback, an
        undocumented exit code, a changed input file, or an output that fails the full check
        where its input passes it."""
        return (self.exit_code not in (0, 2, 3, 4) or "Traceback" in self.stderr
                or "internal error" in self.stderr or self.input_changed
                or self.output_check_error is not None)


def run_case(case: Case, workdir: Path) -> Outcome:
    """One CLI run in this process; stdout dropped, stderr kept."""
    from amp_rewrite.cli import main

    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / f"fuzz_{case.seed}.onnx"
    _write_model(case, src)
    flags = list(case.flags)
    if case.calibration is not None:
        npz = workdir / f"fuzz_{case.seed}.npz"
        np.savez(npz, **case.calibration)
        flags[flags.index("--calibrate")] = f"--calibrate={npz}"
    out = workdir / f"fuzz_{case.seed}.out.onnx"
    before = _digests(workdir)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main([str(src), "-o", str(out), "-q", *flags])
    changed = any(_digests(workdir).get(name) != d for name, d in before.items())
    check_error = _regressed_check(src, out) if code == 0 else None
    for p in workdir.iterdir():
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return Outcome(case, code, err.getvalue(), changed, check_error)


def _digests(workdir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in workdir.iterdir() if p.is_file()}


def _full_check_error(path: Path) -> str | None:
    try:
        onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    except Exception as e:  # noqa: BLE001 - the loader and the checker raise many types
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


def _regressed_check(src: Path, out: Path) -> str | None:
    """The output's full-check error where the input passes the full check, else None (an
    input that fails it may give an output that fails it the same way)."""
    if not out.is_file():
        return "exit 0 but no output file"
    error = _full_check_error(out)
    if error is None or _full_check_error(src) is not None:
        return None
    return error
