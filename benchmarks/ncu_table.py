"""Nsight Compute's per-kernel figures as tables: the kernels in launch order (one MoE layer of them where the
profile holds a whole step), the kernels by name, and with --stalls the warp stall samples.

    export DEEPINFER_XLA_DEFAULTS=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
    ncu --profile-from-start off --clock-control none --metrics "$(python3 benchmarks/ncu_table.py --metrics)" \\
        --csv --page raw python3 benchmarks/ncu_attention.py --output > ATTN.csv
    python3 benchmarks/ncu_table.py ATTN.csv
    ncu --import REPORT.ncu-rep --page raw --csv | python3 benchmarks/ncu_table.py --stalls /dev/stdin

ncu replays each kernel on its own (serialised, its inputs restored), so a kernel's duration here is its own
time, without the overlap PDL gives its neighbours in a step's CUDA graph and without the profiler-trace
overhead of `step_profile.py --trace`. DRAM bytes are what the kernel moved to and from device memory; the
bandwidth column is those bytes over the duration. Reads no JAX. (Under ncu the engine's whole step program,
step_profile.py, has segfaulted ~10 s in; profile the attention script instead.)
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from collections import defaultdict

METRICS = (
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_bytes.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__grid_size",
    "launch__block_size",
    "launch__registers_per_thread",
    "launch__shared_mem_per_block",
)
STALL = "smsp__pcsamp_warps_issue_stalled_"  # the warp state samples' metrics, one a stall reason
MOE_FIRST = r"gate_up|_single_launch_kernel"  # the first kernel of a MoE layer's expert launch
_TIME = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
_BYTES = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3, "KB": 1e-3, "MB": 1.0, "GB": 1e3}


def read_rows(text: str) -> list[dict]:
    """The kernels of ncu's `--csv --page raw` output (any program output before its header skipped): one dict a
    kernel, durations in us and bytes in MB."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header (a line starting with \"ID\") in the input")
    table = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units, body = table[0], table[1], table[2:]
    rows = []
    for raw in body:
        if len(raw) != len(header):
            continue
        row = {}
        for name, unit, value in zip(header, units, raw):
            unit = unit.split("/")[0]  # "Kbyte/block" -> "Kbyte"
            if name in METRICS:
                v = float(value.replace(",", "")) if value not in ("", "n/a") else float("nan")
                if name == "gpu__time_duration.sum":
                    v *= _TIME.get(unit, 1.0)
                elif name.startswith(("dram__bytes", "lts__t_bytes")):
                    v *= _BYTES.get(unit, 1.0)
                elif name == "launch__shared_mem_per_block":
                    v *= _BYTES.get(unit, 1e-3) * 1e3  # KB
                row[name] = v
            elif name == "Kernel Name":
                row["name"] = value
            elif name.startswith(STALL) and not name.endswith("_not_issued") and value not in ("", "n/a"):
                row.setdefault("stalls", {})[name[len(STALL):]] = float(value.replace(",", ""))
        rows.append(row)
    return rows


def one_layer(rows: list[dict], layer: int = 2) -> list[dict]:
    """The kernels from the `layer`-th MoE launch (0-based) up to the next one, in launch order."""
    marks = [i for i, r in enumerate(rows) if re.search(MOE_FIRST, r.get("name", ""))]
    if len(marks) < layer + 2:
        return rows
    return rows[marks[layer]:marks[layer + 1]]


def print_tables(rows: list[dict], out=None) -> None:
    out = out or sys.stdout
    g = lambda r, k: r.get(k, float("nan"))  # noqa: E731
    print(f"{len(rows)} kernels, {sum(g(r, 'gpu__time_duration.sum') for r in rows):,.1f} us in all (serialised)",
          file=out)
    print("\nin launch order (one MoE layer: from an expert launch to the next, where there are such):", file=out)
    print(f"  {'us':>7} {'DRAM rd MB':>10} {'wr MB':>7} {'TB/s':>5} {'DRAM%':>5} {'L2 MB':>7} {'SM%':>4} "
          f"{'occ%':>4} {'grid':>6} {'blk':>4} {'regs':>4} {'smemKB':>6}  kernel", file=out)
    for r in one_layer(rows):
        us = g(r, "gpu__time_duration.sum")
        mb = g(r, "dram__bytes_read.sum") + g(r, "dram__bytes_write.sum")
        print(f"  {us:7.1f} {g(r, 'dram__bytes_read.sum'):10.2f} {g(r, 'dram__bytes_write.sum'):7.2f} "
              f"{mb / us if us else 0:5.2f} {g(r, 'dram__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f} "
              f"{g(r, 'lts__t_bytes.sum'):7.2f} {g(r, 'sm__throughput.avg.pct_of_peak_sustained_elapsed'):4.0f} "
              f"{g(r, 'sm__warps_active.avg.pct_of_peak_sustained_active'):4.0f} {g(r, 'launch__grid_size'):6.0f} "
              f"{g(r, 'launch__block_size'):4.0f} {g(r, 'launch__registers_per_thread'):4.0f} "
              f"{g(r, 'launch__shared_mem_per_block'):6.1f}  {r.get('name', '')[:70]}", file=out)
    total, count, mbs = defaultdict(float), defaultdict(int), defaultdict(float)
    for r in rows:
        total[r.get("name", "")] += g(r, "gpu__time_duration.sum")
        count[r.get("name", "")] += 1
        mbs[r.get("name", "")] += g(r, "dram__bytes_read.sum") + g(r, "dram__bytes_write.sum")
    print("\nthe step by kernel name:", file=out)
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {us:9.1f} us  x{count[name]:4d}  {mbs[name] / us if us else 0:5.2f} TB/s  {name[:90]}", file=out)


def print_stalls(rows: list[dict], out=None) -> None:
    """Each kernel's warp stall samples by reason, as shares of its samples (the `full` section set's)."""
    out = out or sys.stdout
    for r in rows:
        stalls = r.get("stalls") or {}
        total = sum(stalls.values())
        if not total:
            continue
        top = sorted(stalls.items(), key=lambda kv: -kv[1])
        print(f"{r.get('name', '')[:60]}: {total:,.0f} samples; "
              + ", ".join(f"{k} {v / total:.0%}" for k, v in top if v / total >= 0.02), file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="?", help="ncu's --csv --page raw output (program output before it is skipped)")
    ap.add_argument("--metrics", action="store_true", help="print the metric list for ncu's --metrics and exit")
    ap.add_argument("--stalls", action="store_true", help="print the warp stall samples (a `--set full` report's)")
    args = ap.parse_args(argv)
    if args.metrics:
        print(",".join(METRICS))
        return 0
    with open(args.csv) as f:
        rows = read_rows(f.read())
    if args.stalls:
        print_stalls(rows)
    else:
        print_tables(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
