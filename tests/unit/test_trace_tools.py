"""benchmarks/trace_tools.py: reading a perfetto trace file and the device's busy / idle accounting."""

import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.trace_tools import busy_union, gpu_kernels, host_calls, idle_gaps, step_timeline  # noqa: E402


def _trace(tmp_path, kernels):
    """A perfetto JSON with one host and one GPU process; kernels: (name, ts, dur) on the GPU."""
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
              {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
              {"ph": "X", "pid": 1, "tid": 1, "name": "host_op", "ts": 0.0, "dur": 500.0}]
    events += [{"ph": "X", "pid": 7, "tid": 2, "name": n, "ts": t, "dur": d} for n, t, d in kernels]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(tmp_path)


def test_gpu_kernels_keeps_device_events_in_time_order(tmp_path):
    d = _trace(tmp_path, [("b", 20.0, 5.0), ("a", 10.0, 5.0)])
    assert [e["name"] for e in gpu_kernels(d)] == ["a", "b"]
    assert gpu_kernels(str(tmp_path / "missing")) is None


def test_busy_union_counts_overlap_once():
    kern = [{"ts": 0.0, "dur": 10.0}, {"ts": 5.0, "dur": 10.0}, {"ts": 30.0, "dur": 5.0}]
    assert busy_union(kern) == 20.0


def test_idle_gaps_finds_the_gap_between_steps(tmp_path):
    # Two steps of one MoE layer each: gate_up, down, attention; 100 us idle between the steps.
    step = [("_gate_up_kernel", 0.0, 50.0), ("_down_kernel", 50.0, 30.0), ("_kernel", 85.0, 10.0)]
    kern = gpu_kernels(_trace(tmp_path, step + [(n, t + 195.0, d) for n, t, d in step]))
    g = idle_gaps(kern, moe_layers=1)
    assert g["steps"] == 2
    assert g["busy_us"] == 90.0  # (50 + 30 + 10) per step
    assert g["window_us"] == 145.0  # 290 us from the first start to the last end, over 2 steps
    assert g["gaps"] == 0.5 and g["gap_total_us"] == 50.0  # the one 100 us gap; the 5 us ones are below 20
    assert g["largest"][0] == (100.0, "_kernel", "_gate_up_kernel")
    assert g["by_pair"][0] == (50.0, "_kernel", "_gate_up_kernel")  # 100 us over 2 steps
    assert g["by_pair"][1] == (5.0, "_down_kernel", "_kernel")  # 5 us in each step


def test_step_timeline_gives_each_step_its_period_busy_and_idle_time(tmp_path):
    # Three steps of two MoE layers (gate_up, down each): the second step runs 40 us of kernels more
    # than the first (a longer attention), the third starts after 300 us of idle.
    def step(t0, attn):
        return [("_gate_up_kernel", t0, 50.0), ("_down_kernel", t0 + 50.0, 30.0), ("_kernel", t0 + 80.0, attn),
                ("_gate_up_kernel", t0 + 80.0 + attn, 50.0), ("_down_kernel", t0 + 130.0 + attn, 30.0)]

    kern = gpu_kernels(_trace(tmp_path, step(0.0, 10.0) + step(200.0, 50.0) + step(800.0, 10.0)))
    rows = step_timeline(kern, moe_layers=2)
    assert [r["period_us"] for r in rows] == [200.0, 600.0]  # the last step has no successor
    assert [r["busy_us"] for r in rows] == [170.0, 210.0]
    assert [r["idle_us"] for r in rows] == [30.0, 390.0]
    assert [r["kernels"] for r in rows] == [5, 5]


def test_host_calls_counts_driver_calls_per_step_outside_the_gpu(tmp_path):
    d = _trace(tmp_path, [("cuLaunchKernel", 0.0, 5.0)])  # a GPU event of that name is not a host call
    loaded = gpu_kernels(d)
    assert [e["name"] for e in loaded] == ["cuLaunchKernel"]
    folder = tmp_path / "plugins" / "profile" / "run"
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
              {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
              {"ph": "X", "pid": 7, "tid": 2, "name": "cuLaunchKernel", "ts": 0.0, "dur": 99.0}]
    events += [{"ph": "X", "pid": 1, "tid": 1, "name": "cuLaunchKernel", "ts": float(i), "dur": 4.0}
               for i in range(6)]
    events += [{"ph": "X", "pid": 1, "tid": 1, "name": "cuGraphLaunch", "ts": 10.0 + i, "dur": 30.0}
               for i in range(2)]
    events.append({"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction", "ts": 0.0, "dur": 500.0})
    with gzip.open(folder / "host.perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert host_calls(d, steps=2) == [("cuGraphLaunch", 1.0, 30.0), ("cuLaunchKernel", 3.0, 12.0)]


def test_print_report_counts_steps_from_the_moe_launches(tmp_path, capsys):
    step = [("_gate_up_kernel", 0.0, 50.0), ("_down_kernel", 50.0, 30.0), ("_kernel", 85.0, 10.0)]
    d = _trace(tmp_path, step + [(n, t + 195.0, d) for n, t, d in step])
    from benchmarks.trace_tools import print_report

    assert print_report(d, moe_layers=1)
    out = capsys.readouterr().out
    assert "GPU kernel time per step: 0.09 ms over 3 kernels" in out  # 2 steps counted, 90 us each
    assert not print_report(str(tmp_path / "missing"), moe_layers=1)


def test_host_gaps_names_the_program_call_a_gap_ends_in(tmp_path, capsys):
    from benchmarks.host_gaps import main
    from benchmarks.trace_tools import idle_windows

    kern = [("a", 0.0, 10.0), ("b", 5.0, 20.0), ("c", 2025.0, 5.0), ("d", 2031.0, 5.0)]
    d = _trace(tmp_path, kern)
    # the host: a program call over the gap with a remap-like wait inside it, and an unrelated short call
    path = next((tmp_path / "plugins" / "profile" / "run").iterdir())
    with gzip.open(path, "rt") as f:
        events = json.load(f)
    events["traceEvents"] += [
        {"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction(jit(step))", "ts": 20.0, "dur": 2010.0},
        {"ph": "X", "pid": 1, "tid": 1, "name": "cuGraphLaunch", "ts": 1900.0, "dur": 100.0},
        {"ph": "X", "pid": 1, "tid": 1, "name": "cuGraphLaunch", "ts": 1800.0, "dur": 50.0},
    ]
    with gzip.open(path, "wt") as f:
        json.dump(events, f)
    assert idle_windows(gpu_kernels(d), 1000.0) == [(25.0, 2025.0, "b", "c")]  # the 1 us gap c -> d is not one
    assert main([d, "--min-ms", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 idle gaps of at least 1.0 ms, 2.00 ms in all" in out
    assert "between b and c" in out
    assert "inside PjitFunction(jit(step)) (2.01 ms" in out
    assert "0.15 ms  x    2  cuGraphLaunch" in out


def test_compare_lists_the_kernels_whose_time_a_step_differs_most(tmp_path, capsys):
    """Two configurations' traces: a has 2 steps, b 1; per step, b's attention kernel is 30 us slower and
    its down kernel 5 us faster, and b has a copy a lacks."""
    from benchmarks.trace_tools import compare, print_compare

    def step(t0, attn, down):
        return [("_gate_up_kernel", t0, 50.0), ("_down_kernel", t0 + 50.0, down), ("_kernel", t0 + 90.0, attn)]

    a = _trace(tmp_path / "a", step(0.0, 10.0, 30.0) + step(200.0, 10.0, 30.0))
    b = _trace(tmp_path / "b", step(0.0, 40.0, 25.0) + [("MemcpyD2D", 150.0, 2.0)])
    rows = compare(gpu_kernels(a), gpu_kernels(b), moe_layers=1)
    assert rows[:3] == [("_kernel", 10.0, 40.0), ("_down_kernel", 30.0, 25.0), ("MemcpyD2D", 0.0, 2.0)]
    assert rows[3] == ("_gate_up_kernel", 50.0, 50.0)
    assert print_compare(a, b, moe_layers=1)
    out = capsys.readouterr().out
    assert "a: 2 steps, kernels 0.090 ms a step" in out and "b: 1 steps, kernels 0.117 ms a step" in out
    assert "+30.0  _kernel" in out
