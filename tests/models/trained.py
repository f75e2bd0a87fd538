"""Models trained by someone else, taken from the PyPI wheels that ship them.

The zoo's models have random weights; these carry the values training leaves behind (a
PP-OCRv4 text detector's first BatchNorm has a running variance near 1e8, its first conv
writes values near 1.7e4 on a page). Each entry pins a wheel by version and sha256;
``path(key)`` downloads it once with ``pip download --no-deps`` (pip's own index settings
apply), checks the hash and extracts the model into the cache (``AMP_REWRITE_TEST_CACHE``,
else ``~/.cache/amp_rewrite``). Where the wheel cannot be fetched, ``path`` raises
``Unavailable`` and the tests skip with its message.

``inputs(key, rows, seed)`` gives what each model is meant to read, made here with no data
set: pages and text lines of dark strokes on light paper, normalised as PaddleOCR does, and
voiced 16 kHz audio with a mid-stream LSTM state for Silero VAD.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class Unavailable(RuntimeError):
    """The wheel could not be fetched (no index reachable) or did not match its hash."""


@dataclass(frozen=True)
class Trained:
    package: str
    version: str
    sha256: str  # of the wheel
    member: str  # the model's path inside the wheel
    license: str
    about: str


MODELS = {
    # PaddleOCR's PP-OCRv4 text detector (DBNet, opset 12), as RapidOCR ships it
    "ppocr_det": Trained(
        "rapidocr-onnxruntime", "1.4.4",
        "971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf",
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx", "Apache-2.0",
        "PP-OCRv4 text detector: conv net, BatchNorm variance up to 9.8e7"),
    # the same wheel's text recogniser (conv + attention, CTC head) and line-angle classifier
    "ppocr_rec": Trained(
        "rapidocr-onnxruntime", "1.4.4",
        "971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf",
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx", "Apache-2.0",
        "PP-OCRv4 text recogniser: conv backbone, attention neck, CTC head"),
    "ppocr_cls": Trained(
        "rapidocr-onnxruntime", "1.4.4",
        "971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf",
        "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx", "Apache-2.0",
        "PP-OCR text-line angle classifier: MobileNetV3, opset 11"),
    # Silero VAD v6, 16 kHz, opset 15: If subgraphs around conv encoder + LSTM decoder
    "silero_vad": Trained(
        "silero-vad", "6.2.3",
        "7b7f5436cfcb02fae583a05b512ea96467fd449fe54cb49a5e4f06c51a1e43b8",
        "silero_vad/data/silero_vad_16k_op15.onnx", "MIT",
        "Silero VAD: voice activity from 512 samples of 16 kHz audio and an LSTM state"),
}


def cache_dir() -> Path:
    root = os.environ.get("AMP_REWRITE_TEST_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "amp_rewrite"


def path(key: str) -> Path:
    """The model file of ``key``, fetched and checked on first use."""
    entry = MODELS[key]
    target = cache_dir() / "trained" / f"{key}-{entry.version}.onnx"
    if target.is_file():
        return target
    with zipfile.ZipFile(_wheel(entry)) as archive:
        data = archive.read(entry.member)
    _write_atomically(target, data)
    return target


def _wheel(entry: Trained) -> Path:
    """The entry's wheel in the cache (several models share one), downloaded once."""
    wheel = cache_dir() / "trained" / "wheels" / f"{entry.package}-{entry.version}.whl"
    if not wheel.is_file():
        wheel.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=wheel.parent) as tmp:
            os.replace(_download(entry, Path(tmp)), wheel)  # atomic: whole or absent
    return wheel


def _write_atomically(target: Path, data: bytes) -> None:
    """A parallel test sees the whole file or none."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, target)


def _download(entry: Trained, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--quiet", "--dest", str(into), f"{entry.package}=={entry.version}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"pip download {entry.package}=={entry.version}: {e}") from None
    wheels = list(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise Unavailable(f"pip download {entry.package}=={entry.version} failed: {last}")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != entry.sha256:
        raise Unavailable(f"{wheels[0].name}: sha256 {digest}, expected {entry.sha256}")
    return wheels[0]


# ImageNet statistics, which PaddleOCR's detector normalises its input with
_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
_STD = np.array([0.229, 0.224, 0.225], np.float32)


def page(rng: np.random.Generator, height: int = 96, width: int = 160) -> np.ndarray:
    """A (3, height, width) page: light paper with noise, and lines of dark vertical
    strokes of varied ink, normalised as the detector expects."""
    image = np.full((height, width, 3), 235.0, np.float32)
    image += rng.normal(0.0, 6.0, image.shape).astype(np.float32)
    for _ in range(6):
        top = int(rng.integers(4, height - 12))
        left = int(rng.integers(4, width - 40))
        for k in range(int(rng.integers(3, 8))):
            x = left + 5 * k
            image[top:top + int(rng.integers(6, 10)), x:x + 2] = rng.uniform(10.0, 60.0)
    image = (np.clip(image, 0, 255) / 255.0 - _MEAN) / _STD
    return image.transpose(2, 0, 1).astype(np.float32)


def text_line(rng: np.random.Generator, width: int) -> np.ndarray:
    """A (3, 48, width) crop of one text line, normalised to [-1, 1] as PaddleOCR's
    recogniser and classifier expect."""
    image = page(rng, 48, width) * _STD[:, None, None] + _MEAN[:, None, None]  # back to [0, 1]
    return ((image - 0.5) / 0.5).astype(np.float32)


def speech(rng: np.random.Generator, samples: int = 512) -> np.ndarray:
    """Samples of a voiced sound at 16 kHz: a 120-220 Hz fundamental with harmonics under
    a syllable's envelope, plus noise, peaking near 0.3."""
    t = np.arange(samples) / 16_000
    f0 = rng.uniform(120, 220)
    voice = sum(np.sin(2 * np.pi * f0 * k * t + rng.uniform(0, 2 * np.pi)) / k
                for k in range(1, 6))
    envelope = np.sin(np.pi * np.linspace(0.1, 0.9, samples))
    wave = 0.15 * envelope * voice + rng.normal(0, 0.01, samples)
    return wave.astype(np.float32)


def inputs(key: str, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``rows`` inputs of ``key``, keyed by the model's input name."""
    rng = np.random.default_rng(seed)
    if key == "ppocr_det":
        return {"x": np.stack([page(rng) for _ in range(rows)])}
    if key == "ppocr_rec":
        return {"x": np.stack([text_line(rng, 320) for _ in range(rows)])}
    if key == "ppocr_cls":
        return {"x": np.stack([text_line(rng, 192) for _ in range(rows)])}
    if key == "silero_vad":
        state = rng.normal(0, 0.1, (2, rows, 128)).astype(np.float32)  # mid-stream
        return {"input": np.stack([speech(rng) for _ in range(rows)]), "state": state,
                "sr": np.array(16_000, np.int64)}
    raise KeyError(key)
