"""The command-line flags for RunnerConfig's implementation choices, shared by the benchmark scripts."""

from __future__ import annotations

import argparse

from deepinfer_jax.config import RunnerConfig

# RunnerConfig's on / off implementation choices: (field, what it does). Each is a --[no-]flag whose default is
# RunnerConfig's.
SWITCHES = [
    ("fuse_shared_experts", "run the shared experts inside the Pallas MoE kernels"),
    ("fuse_moe_routing", "route and align decode steps in one Pallas kernel"),
    ("decode_projection_kernel", "decode steps' projections read in place by kernels/decode_matmul.py"),
    ("decode_output_kernel", "decode steps merge the attention's splits and apply W_UV in one kernel"),
    ("decode_absorb_kernel", "decode steps absorb the query through W_UK in one kernel reading q_nope and "
                             "W_UK in place"),
    ("decode_latent_kernel", "the absorb kernel's launch also norms, ropes and writes the step's latents "
                             "into the KV cache"),
    ("decode_merged_qkv", "the q / kv_a projections as one GEMM whose output the absorb launch reads in place"),
    ("moe_single_launch", "decode steps run the MoE's two expert kernels in one launch"),
    ("decode_route_launch", "decode MoE layers go from o_proj's partials to the routing in one launch"),
    ("decode_moe_launch", "with the route launch, the routing and the expert kernels in one launch, the shared "
                          "experts' tiles streaming while the routing runs"),
    ("moe_prefill_mosaic", "prefill-size MoE steps run the expert GEMMs on Mosaic GPU (kernels/moe_gmm_mgpu.py)"),
    ("prefill_context_variant", "prefill buckets' programs with and without the context part, picked on the "
                                "host, instead of a lax.cond a layer"),
    ("greedy_variant", "decode buckets get a program for all-greedy steps, without the draw"),
    ("prefill_shared_forward", "prefill buckets run a step as the bucket's forward, shared by its sampling "
                               "variants, then the variant's sampler: fewer programs to compile"),
    ("decode_shared_forward", "with it, decode buckets' steps too: each decode bucket's forward compiled once for "
                              "its sampling variants"),
]


def add_variant_flags(ap: argparse.ArgumentParser) -> None:
    """--[no-]<switch> for each of SWITCHES, and --prefill-attention (RunnerConfig's defaults)."""
    for field, what in SWITCHES:
        default = RunnerConfig.__dataclass_fields__[field].default
        ap.add_argument("--" + field.replace("_", "-"), action=argparse.BooleanOptionalAction, default=default,
                        help=f"{what} (RunnerConfig.{field})")
    ap.add_argument("--prefill-attention", choices=["expanded", "absorbed"], default=RunnerConfig.prefill_attention,
                    help="prefill steps' attention form (RunnerConfig.prefill_attention)")
    ap.add_argument("--decode-moe-launch-tokens", type=_token_counts, default=RunnerConfig.decode_moe_launch_tokens,
                    help="the step sizes (token slots, comma-separated, or 'all') the route-and-experts launch runs "
                         "at (RunnerConfig.decode_moe_launch_tokens)")
    ap.add_argument("--decode-moe-shared-tiles", type=_tiles, default=RunnerConfig.decode_moe_shared_tiles,
                    help="the route-and-experts launch's shared-expert tiles: rows,gate_up columns,down columns "
                         "(RunnerConfig.decode_moe_shared_tiles; 'none': the routed tiles' sizes)")
    ap.add_argument("--prefill-layers", choices=["scan", "indexed"], default=RunnerConfig.prefill_layers,
                    help="how steps above the unroll limit run their layers (RunnerConfig.prefill_layers; "
                         "default: indexed on a GPU)")


def _ints(none_word: str):
    """A parser of comma-separated ints ('32,64' -> (32, 64)) that reads `none_word` as None."""
    return lambda text: None if text == none_word else tuple(int(t) for t in text.split(","))


_tiles = _ints("none")  # '32,64,256' -> (32, 64, 256)
_token_counts = _ints("all")  # '32,64' -> (32, 64)


def variant_kwargs(args: argparse.Namespace) -> dict:
    """The RunnerConfig fields those flags set."""
    return {field: getattr(args, field) for field, _ in SWITCHES} | {
        "prefill_attention": args.prefill_attention, "prefill_layers": args.prefill_layers,
        "decode_moe_launch_tokens": args.decode_moe_launch_tokens,
        "decode_moe_shared_tiles": args.decode_moe_shared_tiles}
