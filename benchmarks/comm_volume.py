"""Predicted communication per step for each layout (sharding/comm.py), so multi-GPU runs have a figure to check.

    python benchmarks/comm_volume.py [--preset deepseek-v3] [--layouts 8x1 8x1ep 4x2ep 1x8ep ...]
        [--decode-seqs 64] [--prefill-tokens 2048] [--dtype-bytes 2]

For each layout ("TPxDP[ep]" as tests/sharding/run_case.py, with "-a2a" for --all2all-backend all_to_all and "-ppN"
for N pipeline stages: "2x4ep-a2a", "4x1-pp2"), prints the collectives of a decode step (--decode-seqs sequences a
data rank, one token each) and of a prefill step (--prefill-tokens token slots and --decode-seqs sequence rows a
data rank), the bytes each device sends or receives (with PP, a device of the busiest stage), and the time that
takes at --link-gbps (per direction; NVLink 4 on H100/H200: about 450 GB/s, a 400 Gb/s NIC about 50 GB/s).
An all-to-all layout gets two rows a step: its worst case (every buffer T_s rows, the dropless bound) and
"uniform", the capacity-ladder rung a step with uniformly random routing lands on (the expected count of tokens
a device receives from one source, rounded up the ladder; fluctuations may take the next rung).
A pipeline layout also gets "prefill /N": the prefill step run as N micro-batches of --prefill-tokens / N token
slots each (runner/micro_batches.py's split of a batch of many prompts on N stages).
No JAX, no device: the model's config.json (configs/models/<preset>.json) and the layout alone.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from deepinfer_jax.config import ModelConfig  # noqa: E402
from deepinfer_jax.sharding import ParallelConfig  # noqa: E402
from deepinfer_jax.sharding.comm import format_table, step_bytes  # noqa: E402
from deepinfer_jax.sharding.layout import VOCAB_PADDING  # noqa: E402


def parse_layout(name: str) -> ParallelConfig:
    name, _, pp = name.partition("-pp")
    name, a2a = name.removesuffix("-a2a"), name.endswith("-a2a")
    ep = name.endswith("ep")
    tp, dp = (int(x) for x in name.removesuffix("ep").split("x"))
    return ParallelConfig(tp, dp, ep, int(pp or 1), all2all_backend="all_to_all" if a2a else "allgather_reducescatter")


def uniform_capacity(cfg: ModelConfig, pc: ParallelConfig, tokens: int) -> int:
    """The capacity-ladder rung a step of uniformly random routing needs: T_s tokens a source, each reaching a
    given device with probability 1 - C(E - E/n, k) / C(E, k) (k distinct experts of E, E/n on the device)."""
    from math import comb

    from deepinfer_jax.models.moe_a2a import capacity_ladder

    E, k, n = cfg.n_routed_experts, cfg.num_experts_per_tok, pc.expert_parallel_size
    Ts = -(-tokens // pc.tensor_parallel_size)
    need = Ts * (1 - comb(E - E // n, k) / comb(E, k))
    return next(c for c in capacity_ladder(Ts) if c >= need)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="deepseek-v3", help="configs/models/<preset>.json")
    ap.add_argument("--layouts", nargs="+", default=["8x1", "8x1ep", "4x2ep", "2x4ep", "1x8ep", "2x4ep-a2a",
                                                     "1x8ep-a2a", "4x1-pp2", "8x1-pp2", "1x8ep-pp2"])
    ap.add_argument("--decode-seqs", type=int, default=64, help="sequences a data rank in the decode step")
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="token slots a data rank in the prefill step")
    ap.add_argument("--dtype-bytes", type=int, default=2, help="2: bf16")
    ap.add_argument("--link-gbps", type=float, default=450.0, help="GB/s per direction a device's link moves")
    ap.add_argument("--verbose", action="store_true", help="every collective, not only the totals")
    a = ap.parse_args(argv)
    cfg = _load(a.preset)
    steps = {"decode": (a.decode_seqs, a.decode_seqs), "prefill": (a.prefill_tokens, a.decode_seqs)}
    print(f"{a.preset}: D={cfg.hidden_size} V={cfg.vocab_size} layers={cfg.num_hidden_layers} "
          f"experts={cfg.n_routed_experts} k={cfg.num_experts_per_tok}; {a.dtype_bytes}-byte activations; "
          f"link {a.link_gbps:g} GB/s")
    print(f"{'layout':10s} {'step':16s} {'tokens/rank':>11s} {'MiB/device':>11s} {'ms at link':>10s}")
    for name in a.layouts:
        pc = parse_layout(name)
        tp = pc.tensor_parallel_size
        c = cfg if cfg.vocab_size % tp == 0 else cfg.with_vocab_multiple(VOCAB_PADDING * tp)
        a2a = pc.all2all_backend == "all_to_all" and pc.expert_parallel_size > 1
        pp = pc.pipeline_parallel_size
        rows = [(step, tokens, seqs, None) for step, (tokens, seqs) in steps.items()]
        if pp > 1:
            mb = a.prefill_tokens // pp
            rows.append((f"prefill /{pp}", a.prefill_tokens, a.decode_seqs, (pp, mb, min(mb, a.decode_seqs))))
        for step, tokens, seqs, micro in rows:
            for label, cap in ([(step + " worst", None), (step + " uniform", uniform_capacity(c, pc, tokens))]
                               if a2a else [(step, None)]):
                b = step_bytes(c, pc, tokens, seqs, a.dtype_bytes, cap, micro)
                print(f"{name:10s} {label:16s} {tokens:11d} {b / 2**20:11.2f} {b / (a.link_gbps * 1e9) * 1e3:10.3f}")
                if a.verbose and micro is None:
                    print(format_table(c, pc, tokens, seqs, a.dtype_bytes, cap))
    return 0


def _load(preset: str) -> ModelConfig:
    import json

    with open(os.path.join(os.path.dirname(HERE), "configs", "models", f"{preset}.json")) as f:
        return ModelConfig.from_hf_dict(json.load(f))


if __name__ == "__main__":
    sys.exit(main())
