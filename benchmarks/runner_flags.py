"""The command-line flags for RunnerConfig's implementation choices, shared by the benchmark scripts."""

from __future__ import annotations

import argparse


def add_variant_flags(ap: argparse.ArgumentParser) -> None:
    """--[no-]fuse-shared-experts, --[no-]fuse-moe-routing, --prefill-attention, --[no-]decode-projection-kernel,
    --[no-]decode-output-kernel, --[no-]decode-absorb-kernel (RunnerConfig's defaults)."""
    ap.add_argument("--fuse-shared-experts", action=argparse.BooleanOptionalAction, default=True,
                    help="run the shared experts inside the Pallas MoE kernels (RunnerConfig.fuse_shared_experts)")
    ap.add_argument("--fuse-moe-routing", action=argparse.BooleanOptionalAction, default=True,
                    help="route and align decode steps in one Pallas kernel (RunnerConfig.fuse_moe_routing)")
    ap.add_argument("--prefill-attention", choices=["expanded", "absorbed"], default="expanded",
                    help="prefill steps' attention form (RunnerConfig.prefill_attention)")
    ap.add_argument("--decode-projection-kernel", action=argparse.BooleanOptionalAction, default=True,
                    help="decode steps' projections read in place by kernels/decode_matmul.py "
                         "(RunnerConfig.decode_projection_kernel)")
    ap.add_argument("--decode-output-kernel", action=argparse.BooleanOptionalAction, default=True,
                    help="decode steps merge the attention's splits and apply W_UV in one kernel "
                         "(RunnerConfig.decode_output_kernel)")
    ap.add_argument("--decode-absorb-kernel", action=argparse.BooleanOptionalAction, default=True,
                    help="decode steps absorb the query through W_UK in one kernel reading q_nope and W_UK in "
                         "place (RunnerConfig.decode_absorb_kernel)")
    ap.add_argument("--decode-router-kernel", action=argparse.BooleanOptionalAction, default=False,
                    help="decode MoE layers add o_proj's partials to the residual, norm and compute the router "
                         "logits in one kernel (RunnerConfig.decode_router_kernel)")


def variant_kwargs(args: argparse.Namespace) -> dict:
    """The RunnerConfig fields those flags set."""
    return dict(fuse_shared_experts=args.fuse_shared_experts, fuse_moe_routing=args.fuse_moe_routing,
                prefill_attention=args.prefill_attention,
                decode_projection_kernel=args.decode_projection_kernel,
                decode_output_kernel=args.decode_output_kernel, decode_absorb_kernel=args.decode_absorb_kernel,
                decode_router_kernel=args.decode_router_kernel)
