"""Write amp_rewrite/onnx/data/cuda_kernels.json: onnxruntime's CUDA kernel registry.

``validate.cuda_kernels`` says whether the CUDA provider has a kernel for every fp16 or bf16
node of an output. Where the installed onnxruntime's CUDA provider loads it lists the
registry itself; elsewhere it reads this file, the registry of the onnxruntime-gpu this script
ran with: per domain and op, each kernel's [since, until (null: open), float types], the
types being those of all the kernel's type constraints among float, float16 and bfloat16
(what ``cuda_kernels`` compares; kernels with neither 16-bit type are left out).

Where the CUDA provider loads (a GPU machine with onnxruntime-gpu and its CUDA):

    python tools/cuda_registry.py

The listing (``get_all_opkernel_def``) constructs every provider the wheel ships and crashes
on one whose library does not load, TensorRT's included; where TensorRT is not installed,
add ``--stubs /tmp/cudareg/stub --tensorrt-only`` (stand-ins for its libraries, below).

On a machine without a GPU the registry can be listed too: listing it needs the
provider's library to load and its constructor to return, not a device. With onnxruntime-gpu 1.31.1 (CUDA 13), from the checkout's root:

    pip install --no-deps --target /tmp/cudareg/site nvidia-cuda-runtime==13.0.96 \\
        nvidia-cuda-crt==13.0.88 nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35
    python tools/cuda_registry.py --stubs /tmp/cudareg/stub --cuda /tmp/cudareg/site/nvidia/cu13

``--stubs DIR`` compiles (gcc) into DIR what the machine lacks: libcuda.so.1, the driver,
whose entry points answer CUDA_ERROR_NO_DEVICE; libcudart_shim.so, preloaded, where
cudaSetDevice, cudaGetDeviceProperties, cudaMemGetInfo and the like the provider's
constructor calls succeed without a device; and load-time stand-ins for the TensorRT
provider's libnvinfer.so.10, libnvonnxparser.so.10 and libcudnn.so.9 (only these with
``--tensorrt-only``). ``--cuda``
is the CUDA libraries' folder (lib/, include/: the wheels above, installed by one pip
command, as a second ``--target`` install into the same folder skips nvidia/; or a CUDA
toolkit). The kernels listed are the provider library's own; nothing here runs one.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from amp_rewrite.onnx import validate  # noqa: E402

OUT = REPO / "amp_rewrite" / "onnx" / validate.CUDA_SNAPSHOT
FLOAT_TYPES = ("float", "float16", "bfloat16")
LOW_TYPES = {"float16", "bfloat16"}

# name: (C source, soname, version script)
STUBS = {
    "libcuda.so.1": ("""
/* the driver: every entry point the CUDA provider links (or cudart looks up) has no device */
#define CUDA_ERROR_NO_DEVICE 100
int cuTensorMapEncodeTiled(void) { return CUDA_ERROR_NO_DEVICE; }
int cuInit(unsigned flags) { (void)flags; return CUDA_ERROR_NO_DEVICE; }
int cuDriverGetVersion(int *v) { if (v) *v = 0; return CUDA_ERROR_NO_DEVICE; }
int cuDeviceGetCount(int *n) { if (n) *n = 0; return CUDA_ERROR_NO_DEVICE; }
int cuGetProcAddress(void) { return CUDA_ERROR_NO_DEVICE; }
int cuGetProcAddress_v2(void) { return CUDA_ERROR_NO_DEVICE; }
int cuGetExportTable(void) { return CUDA_ERROR_NO_DEVICE; }
""", "libcuda.so.1", None),
    "libcudart_shim.so": ("""
/* preloaded: the CUDA runtime calls the providers' constructors make succeed without a device */
#include <string.h>
#include <cuda_runtime_api.h>
cudaError_t cudaSetDevice(int device) { (void)device; return cudaSuccess; }
cudaError_t cudaGetDevice(int *device) { *device = 0; return cudaSuccess; }
cudaError_t cudaGetDeviceCount(int *count) { *count = 1; return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
  (void)device;
  memset(prop, 0, sizeof *prop);
  strcpy(prop->name, "none (kernel registry listing)");
  prop->major = 9;
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
  *free_bytes = *total_bytes = (size_t)1 << 30;
  return cudaSuccess;
}
""", None, "libcudart.so.13 { global: cuda*; local: *; };"),
    "libnvinfer.so.10": ("""
#include <stddef.h>
void *createInferBuilder_INTERNAL(void *logger, int v) { (void)logger; (void)v; return NULL; }
void *createInferRefitter_INTERNAL(void *e, void *logger, int v) { (void)e; (void)logger; (void)v; return NULL; }
void *createInferRuntime_INTERNAL(void *logger, int v) { (void)logger; (void)v; return NULL; }
int getInferLibVersion(void) { return 101300; }
void *getPluginRegistry(void) { return NULL; }
""", "libnvinfer.so.10", None),
    "libnvonnxparser.so.10": ("""
#include <stddef.h>
void *createNvOnnxParser_INTERNAL(void *n, void *logger, int v) { (void)n; (void)logger; (void)v; return NULL; }
void *createNvOnnxParserRefitter_INTERNAL(void *r, void *logger, int v) { (void)r; (void)logger; (void)v; return NULL; }
""", "libnvonnxparser.so.10", None),
    "libcudnn.so.9": ("""
/* 1: CUDNN_STATUS_NOT_INITIALIZED */
int cudnnCreate(void **handle) { if (handle) *handle = 0; return 1; }
int cudnnDestroy(void *handle) { (void)handle; return 0; }
int cudnnSetStream(void *handle, void *stream) { (void)handle; (void)stream; return 1; }
""", "libcudnn.so.9", "libcudnn.so.9 { global: cudnn*; local: *; };"),
}


NO_DEVICE = ("libcuda.so.1", "libcudart_shim.so")  # what a machine with a GPU has


def build_stubs(folder: Path, cuda: Path, names) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        source, soname, version_script = STUBS[name]
        c = folder / f"{name.split('.so')[0]}.c"
        c.write_text(source.lstrip())
        command = ["gcc", "-shared", "-fPIC", "-O2", f"-I{cuda / 'include'}", "-o",
                   str(folder / name), str(c)]
        if soname:
            command.append(f"-Wl,-soname,{soname}")
        if version_script:
            (folder / f"{name}.map").write_text(version_script + "\n")
            command.append(f"-Wl,--version-script={folder / f'{name}.map'}")
        subprocess.run(command, check=True)


def listing_env(stubs: Path, cuda: Path, names) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(stubs), str(cuda / "lib"), str(cuda / "lib64"), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in paths if p)
    if "libcudart_shim.so" in names:
        env["LD_PRELOAD"] = str(stubs / "libcudart_shim.so")
    return env


def compact(kernels) -> dict[str, dict[str, list]]:
    """Per domain and op, each kernel with a 16-bit float type as [since, until, types]."""
    out: dict[str, dict[str, list]] = {}
    for domain, op, (since, until), types in kernels:
        floats = [t for t in FLOAT_TYPES if f"tensor({t})" in types]
        if not LOW_TYPES & set(floats):
            continue
        entry = [since, None if until == validate._ALL_OPSETS else until, floats]
        domain = "" if domain == "ai.onnx" else domain
        entries = out.setdefault(domain, {}).setdefault(op, [])
        if entry not in entries:
            entries.append(entry)
    return {d: {op: sorted(ks, key=lambda k: (k[0], k[1] or validate._ALL_OPSETS, k[2]))
                for op, ks in sorted(ops.items())} for d, ops in sorted(out.items())}


def distribution() -> str:
    names = importlib.metadata.packages_distributions().get("onnxruntime", ["onnxruntime"])
    return next((n for n in names if "gpu" in n), names[0])


def dumps(snapshot: dict) -> str:
    """JSON with one op per line."""
    head = {k: v for k, v in snapshot.items() if k != "kernels"}
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines.append('  "kernels": {')
    domains = list(snapshot["kernels"].items())
    for i, (domain, ops) in enumerate(domains):
        lines.append(f"    {json.dumps(domain)}: {{")
        items = list(ops.items())
        lines += [f"      {json.dumps(op)}: {json.dumps(ks, separators=(',', ':'))}"
                  + ("," if j < len(items) - 1 else "") for j, (op, ks) in enumerate(items)]
        lines.append("    }" + ("," if i < len(domains) - 1 else ""))
    lines += ["  }", "}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stubs", type=Path, help="build the stand-in libraries here and "
                        "list with them (a machine without a GPU)")
    parser.add_argument("--cuda", type=Path, default=Path("/usr/local/cuda"),
                        help="the CUDA libraries' folder, with lib/ or lib64/ and include/")
    parser.add_argument("--tensorrt-only", action="store_true",
                        help="with --stubs on a GPU machine: stand in for TensorRT's "
                        "libraries only")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    import onnxruntime

    env = None
    how = "get_all_opkernel_def() where the CUDA provider loads"
    if args.stubs:
        names = [n for n in STUBS if not (args.tensorrt_only and n in NO_DEVICE)]
        build_stubs(args.stubs, args.cuda, names)
        env = listing_env(args.stubs, args.cuda, names)
        how = ("get_all_opkernel_def() with stand-ins for TensorRT's libraries "
               "(tools/cuda_registry.py --stubs --tensorrt-only)" if args.tensorrt_only else
               "get_all_opkernel_def() on a machine without a GPU: the CUDA provider library "
               "loaded with cuBLAS/cuRAND/cudart 13 wheels and stand-ins for the driver and "
               "the device calls of its constructor (tools/cuda_registry.py --stubs)")
    elif args.tensorrt_only:
        parser.error("--tensorrt-only goes with --stubs DIR")
    kernels = validate.list_cuda_kernels(env)
    if isinstance(kernels, str):
        print(f"cuda_registry: {kernels}", file=sys.stderr)
        return 1
    snapshot = {"onnxruntime": onnxruntime.__version__, "package": distribution(),
                "read": datetime.date.today().isoformat(), "how": how,
                "provider": validate.CUDA, "kernels_listed": len(kernels),
                "kernels": compact(kernels)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(snapshot))
    kept = sum(len(ks) for ops in snapshot["kernels"].values() for ks in ops.values())
    print(f"{args.out}: {len(kernels)} CUDA kernels listed, {kept} with a 16-bit float type "
          f"kept, {args.out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
