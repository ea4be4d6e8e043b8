"""benchmarks/ncu_table.py: reading Nsight Compute's raw CSV page (units normalised) and cutting one layer."""

import csv
import io
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.ncu_table import METRICS, STALL, one_layer, print_stalls, print_tables, read_rows  # noqa: E402


def _csv(kernels):
    """ncu's `--csv --page raw` layout (2025.3: unit strings as it writes them): program output, then a header, a
    units row and a row per kernel; kernels: (name, duration in ns, DRAM bytes read in Mbyte)."""
    header = ["ID", "Process ID", "Kernel Name", "Grid Size", *METRICS]
    units = ["", "", "", "", "ns", "Mbyte", "Kbyte", "%", "Mbyte", "%", "%", "", "", "register/thread", "Kbyte/block"]
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(header)
    w.writerow(units)
    for i, (name, ns, mb) in enumerate(kernels):
        w.writerow([i, 1, name, "(32, 1, 4)", f"{ns:,}", mb, 512, 80.5, 30.0, 10, 25, 128, 128, 96, 110.5])
    return "==PROF== Connected to process 1\nprogram output\n" + buf.getvalue()


def test_rows_are_read_with_units_normalised():
    rows = read_rows(_csv([("_kernel", 12_100, 23.6), ("fusion_1", 1_500, 0.5)]))
    assert [r["name"] for r in rows] == ["_kernel", "fusion_1"]
    assert rows[0]["gpu__time_duration.sum"] == 12.1              # ns -> us, thousands separator read
    assert rows[0]["dram__bytes_read.sum"] == 23.6                # Mbyte
    assert rows[0]["dram__bytes_write.sum"] == 0.512              # Kbyte -> MB
    assert rows[0]["launch__shared_mem_per_block"] == 110.5       # KB


def test_one_layer_runs_from_a_moe_launch_to_the_next():
    names = ["embed", "_kernel", "_single_launch_kernel", "add", "_kernel", "_single_launch_kernel", "norm",
             "_single_launch_kernel", "x", "_single_launch_kernel"]
    rows = read_rows(_csv([(n, 1000, 1.0) for n in names]))
    assert [r["name"] for r in one_layer(rows, layer=1)] == ["_single_launch_kernel", "norm"]
    assert [r["name"] for r in one_layer(rows, layer=0)] == ["_single_launch_kernel", "add", "_kernel"]


def test_tables_print_the_step_total_and_names(capsys):
    print_tables(read_rows(_csv([("_kernel", 2_000, 1.0), ("_kernel", 3_000, 1.0), ("gate_up", 5_000, 20.0)])))
    out = capsys.readouterr().out
    assert "3 kernels, 10.0 us in all" in out
    assert "5.0 us  x   2   0.60 TB/s  _kernel" in out  # the two launches summed: 2.6 MB over 5 us
    assert "4.10 TB/s  gate_up" in out


def test_input_without_a_header_is_an_error():
    try:
        read_rows("just program output\n")
    except ValueError as e:
        assert "no ncu CSV header" in str(e)
    else:
        raise AssertionError("expected a ValueError")


def test_stall_samples_are_shares_of_each_kernel():
    header = ["ID", "Kernel Name", STALL + "wait", STALL + "long_scoreboard", STALL + "wait_not_issued", STALL + "drain"]
    text = "\n".join(",".join(f'"{v}"' for v in row) for row in
                     (header, ["", "", "warp", "warp", "warp", "warp"], ["0", "_kernel", "60", "39", "500", "1"]))
    rows = read_rows(text)
    assert rows[0]["stalls"] == {"wait": 60.0, "long_scoreboard": 39.0, "drain": 1.0}  # "_not_issued" left out
    import io

    out = io.StringIO()
    print_stalls(rows, out)
    assert out.getvalue() == "_kernel: 100 samples; wait 60%, long_scoreboard 39%\n"  # under 2% not listed
