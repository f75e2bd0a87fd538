"""The model and its external data file are committed together or not at all.

A run killed at any point (an exception at the last rename, SIGTERM or SIGINT from this or
another process) leaves the previous model/data pair intact and no temporary files; the
orphans of killed runs are removed by later writes.
"""
from __future__ import annotations

import os
import signal

import numpy as np
import onnx
import pytest

from amp_rewrite.onnx import save as saving

from .test_cli import EXAMPLE_INPUTS, run_cli
from ._helpers import T, save, small_model


def _output_prediction(path) -> np.ndarray:
    from amp_rewrite.onnx.validate import session

    return session(onnx.load(str(path))).run(None, dict(np.load(EXAMPLE_INPUTS)))[0]


def test_kill_between_data_and_model_rename_keeps_the_old_pair(ext_model, tmp_path, capsys,
                                                               monkeypatch):
    out = tmp_path / "out.onnx"
    assert run_cli([ext_model, "-o", out, "-q"], capsys)[0] == 0
    first = _output_prediction(out)
    old_data = set(tmp_path.glob("out.onnx.*.data"))
    real_replace = os.replace

    def killed_at_model_rename(src, dst):
        if str(dst) == str(out):
            raise KeyboardInterrupt  # what SIGINT/SIGTERM raise at this point
        real_replace(src, dst)

    monkeypatch.setattr(saving.os, "replace", killed_at_model_rename)
    code, _, _ = run_cli([ext_model, "-o", out, "-q", "--dtype", "bf16"], capsys)
    monkeypatch.setattr(saving.os, "replace", real_replace)
    assert code == 130
    onnx.checker.check_model(str(out), full_check=True)
    np.testing.assert_array_equal(_output_prediction(out), first)  # old model, old weights
    assert not list(tmp_path.glob(".amp_rewrite_tmp-*"))
    orphans = set(tmp_path.glob("out.onnx.*.data")) - old_data  # renamed before the kill
    assert len(orphans) == 1
    # the next write removes the replaced model's data file at once, the orphan once it is
    # an hour old (a younger one could be a concurrent write's)
    assert run_cli([ext_model, "-o", out, "-q"], capsys)[0] == 0
    left = set(tmp_path.glob("out.onnx.*.data"))
    assert not left & old_data and orphans <= left and len(left) == 2
    for orphan in orphans:
        os.utime(orphan, (0, 0))
    assert run_cli([ext_model, "-o", out, "-q"], capsys)[0] == 0
    left = set(tmp_path.glob("out.onnx.*.data"))
    assert len(left) == 1 and not left & (old_data | orphans)
    np.testing.assert_array_equal(_output_prediction(out), first)


def test_data_file_name_is_unique_per_write(ext_model, tmp_path, capsys):
    out = tmp_path / "out.onnx"
    names = []
    for _ in range(2):
        assert run_cli([ext_model, "-o", out, "-q"], capsys)[0] == 0
        names.append({t.name: {kv.key: kv.value for kv in t.external_data}["location"]
                      for t in onnx.load(out, load_external_data=False).graph.initializer
                      if t.data_location == T.EXTERNAL})
    assert names[0] and names[1]
    assert set(names[0].values()).isdisjoint(names[1].values())


def test_sigterm_during_save_removes_temp_files(tmp_path, capsys, monkeypatch):
    src = save(tmp_path, small_model())
    real = saving.save_proto

    def save_then_terminated(proto, output, keep=()):
        with saving._staged(output) as tmp:
            tmp.write_bytes(b"partial")
            os.kill(os.getpid(), signal.SIGTERM)
        return real(proto, output, keep)

    monkeypatch.setattr(saving, "save_proto", save_then_terminated)
    code, _, err = run_cli([src, "-q"], capsys)
    assert code == 143 and "terminated" in err
    assert not list(tmp_path.glob(".amp_rewrite_tmp-*"))
    assert not (tmp_path / "m.amp.onnx").exists()


def test_stale_temp_dirs_of_killed_runs_are_removed(tmp_path, capsys):
    src = save(tmp_path, small_model())
    dead_pid = 2**22 + 12345  # above pid_max's default: no such process
    stale = tmp_path / f"{saving.TEMP_PREFIX}{dead_pid}-abc"
    stale.mkdir()
    (stale / "m.onnx.deadbeef.data").write_bytes(b"\0" * 1024)
    live = tmp_path / f"{saving.TEMP_PREFIX}{os.getppid()}-abc"  # a live process: kept
    live.mkdir()
    foreign = tmp_path / ".other_tool_tmp"
    foreign.mkdir()
    assert run_cli([src, "-q"], capsys)[0] == 0
    assert not stale.exists() and live.exists() and foreign.exists()


SLOW_SAVE_RUN = """
import sys, time
from amp_rewrite.onnx import save as saving
real = saving.save_proto
def slow(proto, output, keep=()):
    with saving._staged(output) as tmp:
        tmp.write_bytes(b"partial")
        print("staged", flush=True)
        time.sleep(60)
    return real(proto, output, keep)
saving.save_proto = slow
from amp_rewrite.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_from_another_process_removes_temp_files(tmp_path, sig, code):
    import subprocess
    import sys

    src = save(tmp_path, small_model())
    # SIGINT as a terminal delivers it: a background job (CI under `cmd &`) inherits SIGINT
    # ignored, and Python then keeps ignoring it
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE_RUN, str(src), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == "staged"
    assert list(tmp_path.glob(".amp_rewrite_tmp-*"))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not list(tmp_path.glob(".amp_rewrite_tmp-*"))
    assert not (tmp_path / "m.amp.onnx").exists()
