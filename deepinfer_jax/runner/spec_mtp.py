"""The runner's side of `deepseek_mtp` speculation (docs/speculative.md): the checkpoint's MTP layer drafts on the
device, in the same step program as the verify step (runner/step_programs.py `_core_fn`, models/mtp.py
`mtp_propose`), and its KV is one more layer of the paged cache (`kv_cache_shape`). The host gives each step the
token after each sequence's last slot where it knows it (`next_token_ids`); the drafts come back with the sampled
tokens (SampleOutput.drafts)."""

from __future__ import annotations

import numpy as np

from deepinfer_jax.config import ModelConfig


def check_supported(cfg: ModelConfig, family: str, collect_routing: bool) -> None:
    """Refuse, in one line, what `deepseek_mtp` does not run on."""
    if not cfg.has_mtp:
        raise ValueError("speculative_config method 'deepseek_mtp' needs a checkpoint with MTP weights "
                         "(num_nextn_predict_layers > 0 and the layer's tensors present); this one has none")
    if family == "deepseek_v4":
        if cfg.v4.mtp_in_cache < 1:
            raise ValueError("deepseek_v4's cache has no rows for the MTP layer (config_v4.with_mtp_cache, which LLMEngine applies)")
    elif family != "deepseek" or cfg.has_indexer:
        raise ValueError(f"speculative_config method 'deepseek_mtp' runs on DeepSeek-V2/V3/V4 models, not "
                         f"{cfg.model_type!r}{' with sparse attention' if cfg.has_indexer else ''}")
    if collect_routing:
        raise ValueError("speculative_config method 'deepseek_mtp' is not supported with collect_routing")


def kv_cache_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The target's cache shape [L, P, page_size, R + dr] -> the one with the MTP layer's latents as layer L."""
    return (shape[0] + 1, *shape[1:])


def next_token_ids(plan_seqs, requests, rows: int) -> np.ndarray:
    """int32 [rows] (StepMetadata.next_token_ids): -1 for a sequence that samples this step, the prompt's token
    after the chunk for one that does not, -2 for a padding row."""
    out = np.full(rows, -2, np.int32)
    for r, seq in enumerate(plan_seqs):
        if seq.sample:
            out[r] = -1
        else:
            end = seq.start_pos + len(seq.token_ids)
            out[r] = requests[seq.request_id].token_ids_slice(end, end + 1)[0]
    return out
