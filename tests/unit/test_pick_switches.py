"""benchmarks/pick_switches.py: the flags of the switches whose step beat the base step, read from real
step_profile.py log lines; no base step, no pick."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.pick_switches import main, step_ms  # noqa: E402

LINE = "  pipelined via compiled: {} ms/step, host enqueue 8.06 ms/step\n"


def _log(d, label, ms):
    (d / f"step_{label}.log").write_text("device step 9.43 ms\n" + ("" if ms is None else LINE.format(ms)))


def test_picks_the_switches_that_beat_the_base_step(tmp_path, capsys):
    for label, ms in [("base", "8.23"), ("qkv", "8.20"), ("oproj", "8.22"), ("route", None)]:
        _log(tmp_path, label, ms)
    assert step_ms(str(tmp_path / "step_qkv.log")) == 8.20 and step_ms(str(tmp_path / "step_route.log")) is None
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out == "--decode-qkv-launch\n"  # oproj's 0.01 ms is under the 0.015 ms bar
    assert main([str(tmp_path), "--min-gain-ms", "0.005"]) == 0
    assert capsys.readouterr().out == "--decode-qkv-launch --decode-oproj-launch\n"


def test_no_base_step_no_pick(tmp_path, capsys):
    _log(tmp_path, "qkv", "8.00")
    assert main([str(tmp_path)]) == 1 and capsys.readouterr().out == ""
