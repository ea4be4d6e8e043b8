"""Speculative decoding's `draft_model` method: a smaller model of the same vocabulary proposes each sequence's
drafts (docs/speculative.md).

`Drafter` loads the draft (any model this engine serves: models/registry.py), refuses at start a draft that cannot
serve (a missing directory, another vocabulary size or tokenizer, a shorter context than max_model_len), and after
the target's runner is built holds the draft's own runner and paged cache (runner/draft_runner.py), whose pages
mirror the target's page ids.

Under tensor or data parallelism the draft runs unsharded on the first device (the simplest exact choice: the
drafts are host-side token ids, and the target verifies every one): with data-parallel ranks its pool holds every
rank's pages (rank r's page p at r * num_pages + p) and each rank's sequences propose in a call of their own.

Before each plan `propose` gives every decoding request (one token to compute, no grammar) up to K greedy drafts.
The draft first catches up on the tokens it has not computed: from the first position its cache does not hold for
this request's page list, through the request's newest token. Its cache holds a request's positions below
`min(what it wrote and kept, the target's num_computed_tokens)`: the positions a proposal wrote within the request's
pages stay valid as far as the target accepted their drafts (an accepted draft is the token the position holds);
those written to scratch pages, and everything of a request whose page list changed (preempted, or new: its
`block_list_generation`), are computed again. A prefix-cache hit is caught up from position 0 (the shared pages'
draft KV is written again, with the same tokens at the same positions).

The drafts are greedy, so q is a point mass at each draft: the rejection sampler accepts draft d with probability
p(d) and the output follows the target's distribution (sampling/rejection.py).
"""

from __future__ import annotations

import logging
import os

from deepinfer_jax.config import ModelConfig, RunnerConfig, SpeculativeConfig

log = logging.getLogger(__name__)


def vocabulary_problem(cfg: ModelConfig, draft_cfg: ModelConfig, tokenizer, draft_dir: str) -> str | None:
    """Why the draft at `draft_dir` cannot propose for a target of `cfg` with `tokenizer` (None: not compared), or
    None: the vocabulary sizes must match, and the tokenizers map every id to the same token."""
    if draft_cfg.vocab_size != cfg.vocab_size:
        return (f"the draft model's vocab_size {draft_cfg.vocab_size} differs from the target's {cfg.vocab_size}: "
                "drafts must be the target's token ids")
    if tokenizer is None:
        return None
    from deepinfer_jax.text import load_tokenizer
    from deepinfer_jax.text.tokenizer import TokenizerNotFoundError

    try:
        theirs = load_tokenizer(draft_dir)
    except TokenizerNotFoundError:
        return f"the draft model directory {draft_dir!r} has no tokenizer to compare with the target's"
    if theirs.vocab_size != tokenizer.vocab_size:
        return (f"the draft model's tokenizer has {theirs.vocab_size} tokens, the target's {tokenizer.vocab_size}: "
                "drafts must be the target's token ids")
    bad = next((i for i in range(tokenizer.vocab_size) if theirs.id_to_token(i) != tokenizer.id_to_token(i)), None)
    if bad is not None:
        return (f"the draft model's tokenizer differs from the target's: id {bad} is {theirs.id_to_token(bad)!r} there, "
                f"{tokenizer.id_to_token(bad)!r} here")
    return None


def _num_ranks(sharding) -> int:
    return 1 if sharding is None else sharding.num_ranks


def drafter_for(spec: SpeculativeConfig | None, cfg: ModelConfig, tokenizer, runner_config: RunnerConfig,
                max_model_len: int, load_format: str = "auto") -> "Drafter | None":
    """The engine's Drafter where `spec` asks for the draft_model method, else None."""
    if spec is None or spec.method != "draft_model":
        return None
    return Drafter(spec, cfg, tokenizer, runner_config, max_model_len, load_format)


class Drafter:
    """The draft model of one engine: loaded and checked at construction, its runner made by `start`."""

    def __init__(self, spec: SpeculativeConfig, cfg: ModelConfig, tokenizer, runner_config: RunnerConfig,
                 max_model_len: int, load_format: str = "auto"):
        import jax.numpy as jnp

        path = spec.model
        if not os.path.isdir(path):
            raise ValueError(f"speculative_config model {path!r} (the draft) is not a directory")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"speculative_config model {path!r} (the draft) has no config.json")
        draft_cfg = ModelConfig.from_model_dir(path)
        problem = vocabulary_problem(cfg, draft_cfg, tokenizer, path)
        if problem:
            raise ValueError(f"speculative_config: {problem}")
        if draft_cfg.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config: the draft model's max_position_embeddings "
                             f"{draft_cfg.max_position_embeddings} is below max_model_len {max_model_len}")
        dtype = jnp.dtype(runner_config.dtype)
        if load_format == "dummy":  # as the target: random weights from config.json (vLLM loads both alike)
            from deepinfer_jax.weights.random_init import pending_random_params

            self.cfg, pending = draft_cfg, pending_random_params(draft_cfg, dtype, seed=runner_config.seed + 1)
        else:
            from deepinfer_jax.weights.loader import prepare_model

            self.cfg, pending = prepare_model(path, dtype, progress=False)
        pending.start()
        # loaded now, before the target's KV cache is sized: its bytes count as in use
        self.params = pending.result()
        self.k = spec.num_speculative_tokens
        self.runner_config = runner_config
        self.runner = None  # runner/draft_runner.py DraftRunner, made by `start`
        self.num_pages = 0  # the target's pages a data-parallel rank (`start`)
        self._state: dict[str, tuple[int, int]] = {}  # request id -> (its block list's generation, positions held)
        log.info("draft model %s (%s, %d layers) proposes %d tokens a step", path, self.cfg.family,
                 self.cfg.num_hidden_layers, self.k)

    def bytes_per_page(self, page_size: int, sharding=None) -> int:
        """The draft cache's bytes on the first device for one page of the target's per rank (device memory sizing,
        which counts that device's bytes; in the compute dtype): with data-parallel ranks its pool holds every
        rank's pages."""
        from deepinfer_jax.runner.draft_runner import DraftRunner

        return DraftRunner.bytes_per_page(self.cfg, page_size, self.runner_config.dtype) * _num_ranks(sharding)

    def start(self, shapes, num_pages: int, progress: bool = True, sharding=None) -> int:
        """Make the draft's runner over the target's pages (`num_pages` a data-parallel rank of `sharding`, rank r's
        page p at r * num_pages + p of the draft's pool) and compile its step programs; returns the number of
        programs compiled or loaded."""
        from deepinfer_jax.runner.draft_runner import DraftRunner

        self.num_pages = num_pages
        self.runner = DraftRunner(self.cfg, self.params, self.runner_config, shapes, num_pages * _num_ranks(sharding),
                                  self.k)
        return self.runner.warmup(progress=progress)

    def propose(self, engine) -> None:
        """Drafts (Request.spec_token_ids) for every running request that decodes next and has no grammar, at most
        K and within max_model_len and max_tokens (the scheduler verifies no more)."""
        from deepinfer_jax.runner.draft_runner import DraftItem

        ps = self.runner.page_size
        held = {}
        # one proposal a data-parallel rank (its own scheduler and page pool), one after another: each rank's
        # sequences fit the draft's step shapes (max_num_seqs and the token buckets hold per rank)
        for rank, sched in enumerate(getattr(engine.scheduler, "ranks", [engine.scheduler])):
            kv, offset, items = sched.kv_cache_manager, rank * self.num_pages, []
            for req in sched.running:
                if req.grammar is not None or req.num_tokens - req.num_computed_tokens != 1:
                    continue
                rid, sp, c = req.request_id, req.sampling_params, req.num_computed_tokens
                n = min(self.k, engine.max_model_len - req.num_tokens - 1)
                if sp.max_tokens is not None:
                    n = min(n, sp.max_tokens - req.num_output_tokens - 1)
                req.spec_token_ids = []
                if n < 1:
                    continue
                gen = kv.block_list_generation(rid)
                old = self._state.get(rid)
                start = min(old[1], c) if gen and old is not None and old[0] == gen else 0
                pages = [offset + p for p in kv.get_block_ids(rid)]
                items.append(DraftItem(rid, req.token_ids_slice(start, c + 1), start, pages, n))
                # kept: what this proposal writes within the request's own pages (positions c .. c + n - 1)
                held[rid] = (gen, min(c + n, len(pages) * ps))
            drafts = self.runner.propose(items)
            for req in sched.running:
                if req.request_id in drafts:
                    req.spec_token_ids = drafts[req.request_id]
        running = {r.request_id for r in engine.scheduler.running}
        self._state = {rid: s for rid, s in {**self._state, **held}.items() if rid in running}
