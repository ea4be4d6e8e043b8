"""Reading jax.profiler's perfetto traces of decode steps: GPU time per kernel and category, one
decoder layer in launch order, and the device's idle gaps (is the engine keeping the GPU busy?).

Used by offline.py (the engine's own loop), step_profile.py (isolated steps), kernels.py, attn_sweep.py,
moe_launch_sweep.py and host_gaps.py."""

from __future__ import annotations

import functools
import glob
import gzip
import json
import os
import re
from collections import defaultdict

CATEGORIES = [  # (category, regex over kernel names), first match wins
    ("MoE grouped GEMM (Pallas)", r"gate_up|_down_kernel|down_kernel|_single_launch_kernel"),
    ("decode projections (Pallas)", r"decode_matmul"),
    ("attention (Pallas: MLA, GQA)", r"mla|_kernel"),
    ("memcpy", r"[Mm]emcpy|copy"),
    ("collectives", r"nccl|all_reduce|all_gather|reduce_scatter|all-reduce|all-gather"),
    ("cuBLAS / cutlass GEMM", r"gemm|cutlass|xmma|cublas|sm90_|sm80_"),
    ("sort", r"sort|Sort|cub::"),
    ("gather / scatter", r"gather|scatter"),
    ("reductions", r"reduce|reduction"),
]

# The first kernel of a layer's MoE: the gate_up kernel, or both expert kernels in one launch
# (RunnerConfig.moe_single_launch).
MOE_FIRST = r"gate_up|_single_launch_kernel"


def _load(trace_dir: str) -> tuple[list[dict], set] | None:
    """(every event, the GPU processes' pids) of the newest perfetto trace under trace_dir; None if none."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    return _read(files[-1], os.path.getmtime(files[-1])) if files else None


@functools.lru_cache(maxsize=2)
def _read(path: str, mtime: float) -> tuple[list[dict], set]:
    """One trace file, parsed once however many readers ask (`mtime` keys a rewritten file anew)."""
    with gzip.open(path) as f:
        events = json.load(f)
    events = events.get("traceEvents", events)
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e.get("pid"), e.get("tid") if e["name"] == "thread_name" else None)] = e["args"]["name"]
    return events, {pid for (pid, tid), n in names.items() if tid is None and not n.startswith("/host")}


def gpu_kernels(trace_dir: str) -> list[dict] | None:
    """Every GPU-side complete event ("X") of the newest perfetto trace under trace_dir, sorted by start
    time (microseconds); None when no trace was written."""
    loaded = _load(trace_dir)
    if loaded is None:
        return None
    events, gpu_pids = loaded
    kern = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids]
    return sorted(kern, key=lambda e: e["ts"])


HOST_CALLS = r"^cu[A-Z]|^cuda|[Gg]raph|CommandBuffer|Thunk"


def host_calls(trace_dir: str, steps: int, top: int = 12) -> list[tuple[str, float, float]]:
    """The host side of the traced steps: (name, calls per step, us per step) of the CUDA driver / runtime
    calls and XLA thunk events (names matching HOST_CALLS) outside the GPU processes, most time first.
    Tells a step launched as one CUDA graph (a cuGraphLaunch per step) from one launched kernel by
    kernel (hundreds of cuLaunchKernel) or re-recorded each step (graph instantiate / update calls)."""
    loaded = _load(trace_dir)
    if loaded is None:
        return []
    events, gpu_pids = loaded
    total, count = defaultdict(float), defaultdict(int)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in gpu_pids and re.search(HOST_CALLS, e.get("name", "")):
            total[e["name"]] += e.get("dur", 0.0)
            count[e["name"]] += 1
    rows = sorted(total, key=lambda n: -total[n])[:top]
    return [(n, count[n] / steps, total[n] / steps) for n in rows]


def busy_union(kern: list[dict]) -> float:
    """Microseconds during which at least one kernel ran (overlapping kernels counted once)."""
    busy, cur_s, cur_e = 0.0, None, None
    for e in kern:
        s, t = e["ts"], e["ts"] + e.get("dur", 0.0)
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    return busy + (0.0 if cur_e is None else cur_e - cur_s)


def first_gpu(kern: list[dict]) -> list[dict]:
    """The kernels of the first GPU traced (the lowest pid), in their order."""
    first = min(k["pid"] for k in kern)
    return [e for e in kern if e["pid"] == first]


def kernel_totals(kern: list[dict]) -> tuple[dict[str, float], dict[str, int]]:
    """({kernel name: microseconds}, {kernel name: launches}) over all the kernels given."""
    total, count = defaultdict(float), defaultdict(int)
    for e in kern:
        total[e["name"]] += e.get("dur", 0.0)
        count[e["name"]] += 1
    return total, count


def count_steps(kern: list[dict], moe_layers: int) -> int:
    """Steps in a trace: its MoE launches (MOE_FIRST) over the MoE layers a step, at least 1."""
    return max(1, sum(1 for e in kern if re.search(MOE_FIRST, e["name"])) // moe_layers)


def compare(kern_a: list[dict], kern_b: list[dict], moe_layers: int, top: int = 20) -> list[tuple[str, float, float]]:
    """Two traces of the same step program(s), e.g. one configuration against another: (kernel name, us a
    step in a, us a step in b) of the `top` kernels whose time a step differs most, the steps of each
    counted from its MoE launches."""
    per_step = []
    for kern in (kern_a, kern_b):
        steps = count_steps(kern, moe_layers)
        per_step.append({n: us / steps for n, us in kernel_totals(kern)[0].items()})
    a, b = per_step
    names = sorted(set(a) | set(b), key=lambda n: -abs(b.get(n, 0.0) - a.get(n, 0.0)))
    return [(n, a.get(n, 0.0), b.get(n, 0.0)) for n in names[:top]]


def print_compare(dir_a: str, dir_b: str, moe_layers: int, top: int = 20) -> bool:
    """`compare` of the newest traces under dir_a and dir_b, with each one's busy time a step."""
    ka, kb = gpu_kernels(dir_a), gpu_kernels(dir_b)
    if not ka or not kb:
        print(f"no GPU kernels under {dir_a if not ka else dir_b}")
        return False
    for label, kern in (("a", ka), ("b", kb)):
        steps = count_steps(kern, moe_layers)
        print(f"{label}: {steps} steps, kernels {sum(kernel_totals(kern)[0].values()) / steps / 1e3:.3f} ms a step, "
              f"busy {busy_union(kern) / steps / 1e3:.3f} ms a step")
    print("us a step:        a          b      b - a  kernel")
    for name, ua, ub in compare(ka, kb, moe_layers, top):
        print(f"  {ua:14.1f} {ub:10.1f} {ub - ua:+10.1f}  {name[:100]}")
    return True


def summarize(kern: list[dict], steps: int, top: int = 40) -> None:
    """GPU time per step by category and by kernel name (summed over the GPUs traced)."""
    total, count = kernel_totals(kern)
    grand = sum(total.values())
    print(f"GPUs traced: {len({e['pid'] for e in kern})} (times below are summed over them)")
    print(f"GPU kernel time per step: {grand / steps / 1e3:.2f} ms over {sum(count.values()) // steps} kernels")
    cats = defaultdict(lambda: [0.0, 0])
    for name, us in total.items():
        cat = next((c for c, pat in CATEGORIES if re.search(pat, name)), "other XLA fusions")
        cats[cat][0] += us
        cats[cat][1] += count[name]
    for cat, (us, n) in sorted(cats.items(), key=lambda kv: -kv[1][0]):
        print(f"  [{cat}] {us / steps / 1e3:7.3f} ms/step  x{n // steps}")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us / steps:9.1f} us/step  x{count[name] // steps:4d}  {name[:110]}")


def layer_sequence(kern: list[dict], layer: int = 10) -> None:
    """Print the kernels of one decoder layer in launch order: those from the `layer`-th MoE gate_up kernel
    up to the next one (on the first GPU), with their durations and the gap before each."""
    kern = first_gpu(kern)
    marks = [i for i, e in enumerate(kern) if re.search(MOE_FIRST, e["name"])]
    if len(marks) <= layer + 1:
        return
    seq = kern[marks[layer]:marks[layer + 1]]
    busy = sum(e.get("dur", 0.0) for e in seq)
    span = seq[-1]["ts"] + seq[-1].get("dur", 0.0) - seq[0]["ts"]
    print(f"one layer in launch order ({len(seq)} kernels, {busy:.1f} us busy, {span:.1f} us span):")
    prev = None
    for e in seq:
        gap = 0.0 if prev is None else e["ts"] - prev
        args = e.get("args", {})
        op = args.get("hlo_op") or args.get("long_name") or ""
        print(f"  {e.get('dur', 0.0):7.1f} us  gap {gap:5.1f}  {e['name'][:60]}  {str(op)[:60]}")
        prev = e["ts"] + e.get("dur", 0.0)


def idle_windows(kern: list[dict], min_us: float) -> list[tuple[float, float, str, str]]:
    """(start, end, kernel before, kernel after) of each idle stretch of at least min_us between the kernels
    (time-sorted); the kernel before is the one whose end opens the stretch, overlaps counted once."""
    out, end, last = [], None, ""
    for e in kern:
        if end is not None and e["ts"] - end >= min_us:
            out.append((end, e["ts"], last, e["name"]))
        if end is None or e["ts"] + e.get("dur", 0.0) > end:
            end, last = e["ts"] + e.get("dur", 0.0), e["name"]
    return out


def idle_gaps(kern: list[dict], moe_layers: int, min_gap_us: float = 20.0) -> dict:
    """How busy the first GPU was over the traced window, and where it idled.

    Steps are counted as MoE gate_up launches / moe_layers. Returns window, busy and idle microseconds
    per step, and the idle gaps of at least `min_gap_us` (count, total per step, the largest) with the
    kernels on either side of the largest, so a gap between steps (host-bound) shows as such."""
    kern = first_gpu(kern)
    steps = count_steps(kern, moe_layers)
    window = kern[-1]["ts"] + kern[-1].get("dur", 0.0) - kern[0]["ts"]
    busy = busy_union(kern)
    gaps = sorted(((b - a, before, after) for a, b, before, after in idle_windows(kern, min_gap_us)), reverse=True)
    # All idle time between kernels, by the pair of kernel names around it (where small gaps add up).
    pairs = defaultdict(float)
    for a, b, before, after in idle_windows(kern, 0.0):
        if b > a:
            pairs[(before[:40], after[:40])] += b - a
    by_pair = sorted(((us / steps, a, b) for (a, b), us in pairs.items()), reverse=True)[:6]
    return {"steps": steps, "window_us": window / steps, "busy_us": busy / steps,
            "idle_us": (window - busy) / steps, "gaps": len(gaps) / steps,
            "gap_total_us": sum(g[0] for g in gaps) / steps, "largest": gaps[:3], "by_pair": by_pair}


def print_idle_gaps(kern: list[dict], moe_layers: int) -> None:
    g = idle_gaps(kern, moe_layers)
    print(f"device over {g['steps']} steps: {g['window_us'] / 1e3:.2f} ms/step, busy {g['busy_us'] / 1e3:.2f} ms, "
          f"idle {g['idle_us'] / 1e3:.2f} ms ({g['gaps']:.1f} gaps >= 20 us per step, "
          f"{g['gap_total_us'] / 1e3:.2f} ms)")
    for us, before, after in g["largest"]:
        print(f"  idle {us:8.1f} us between {before[:50]} and {after[:50]}")
    for us, before, after in g["by_pair"]:
        print(f"  idle {us:8.1f} us/step in all gaps between {before} and {after}")


def step_timeline(kern: list[dict], moe_layers: int) -> list[dict]:
    """One row per step of the first GPU, for a trace that starts at a step's beginning: the step's period
    (from its first MoE gate_up launch to the next step's), the kernel time inside that period
    (overlaps counted once) and the rest idle. A step is `moe_layers` consecutive gate_up launches, so
    the periods are exact whatever else (stage and extract programs, the sampler) sits between steps;
    the last step has no successor and is left out."""
    if not kern:
        return []
    kern = first_gpu(kern)
    marks = [e["ts"] for e in kern if re.search(MOE_FIRST, e["name"])][::moe_layers]
    rows, j = [], 0
    for a, b in zip(marks, marks[1:]):
        while j < len(kern) and kern[j]["ts"] < a:
            j += 1
        inside, i = [], j
        while i < len(kern) and kern[i]["ts"] < b:
            e = kern[i]
            inside.append({"ts": e["ts"], "dur": min(e.get("dur", 0.0), b - e["ts"])})
            i += 1
        busy = busy_union(inside)
        rows.append({"start_us": a - marks[0], "period_us": b - a, "busy_us": busy, "idle_us": b - a - busy,
                     "kernels": len(inside)})
    return rows


def print_step_timeline(kern: list[dict], moe_layers: int, first_decode: int = 0) -> None:
    """The step periods of `step_timeline` in ranges (the first steps one by one, then the rest in
    groups) and the slowest steps: where a run's mean step time goes beyond the steady state."""
    rows = step_timeline(kern, moe_layers)
    if not rows:
        return
    print(f"step timeline ({len(rows)} steps with a successor; decode from step {first_decode}):")
    print("  steps        period ms   busy ms   idle ms   kernels")

    def line(label, rs):
        n = len(rs)
        print(f"  {label:12s} {sum(r['period_us'] for r in rs) / n / 1e3:9.3f} {sum(r['busy_us'] for r in rs) / n / 1e3:9.3f}"
              f" {sum(r['idle_us'] for r in rs) / n / 1e3:9.3f} {sum(r['kernels'] for r in rs) / n:9.0f}")

    for i in range(min(len(rows), first_decode + 4)):
        line(f"{i}", [rows[i]])
    edges = [first_decode + 4, first_decode + 20, first_decode + 60, first_decode + 120, first_decode + 180, len(rows)]
    for a, b in zip(edges, edges[1:]):
        if a < min(b, len(rows)):
            line(f"{a}-{min(b, len(rows)) - 1}", rows[a:b])
    dec = rows[first_decode:]
    if dec:
        line("all decode", dec)
        for i, r in sorted(enumerate(dec), key=lambda ir: -ir[1]["period_us"])[:5]:
            print(f"  slowest: step {first_decode + i}: {r['period_us'] / 1e3:.3f} ms, idle {r['idle_us'] / 1e3:.3f} ms")


def print_report(trace_dir: str, moe_layers: int, steps: int | None = None, top: int = 40) -> bool:
    """Everything above for the newest trace under trace_dir: the idle gaps, GPU time by category and
    kernel, the host calls, one layer in launch order. `steps`: traced steps (default: counted from the
    MoE gate_up launches). False when the trace holds no GPU kernels (or none was written)."""
    kern = gpu_kernels(trace_dir)
    if not kern:
        print(f"no GPU kernels in a perfetto trace under {trace_dir}")
        return False
    steps = steps or max(1, sum("gate_up" in e["name"] for e in kern) // moe_layers)
    print_idle_gaps(kern, moe_layers)
    summarize(kern, steps, top=top)
    print("host calls per step (CUDA driver / runtime, XLA thunks):")
    for name, calls, us in host_calls(trace_dir, steps):
        print(f"  host {us:9.1f} us/step  x{calls:7.1f}  {name[:100]}")
    layer_sequence(kern)
    return True


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(description="compare two traces' GPU time a step, kernel by kernel")
    ap.add_argument("compare", choices=["compare"])
    ap.add_argument("dir_a")
    ap.add_argument("dir_b")
    ap.add_argument("--moe-layers", type=int, default=26, help="MoE layers a step (V2-Lite: 26)")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    sys.exit(0 if print_compare(a.dir_a, a.dir_b, a.moe_layers, a.top) else 1)
