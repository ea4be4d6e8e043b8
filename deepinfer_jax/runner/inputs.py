"""StepPlan -> padded host arrays for one jitted step (numpy only: no device work, no compiles).

Buckets: one dimension. A step of T scheduled tokens is padded to the smallest token bucket >= T,
and its sequence rows to `seq_rows(bucket)` = min(bucket, max_num_seqs rounded to a power of two).
The page table is always `max_pages = cdiv(max_model_len, page_size)` wide. So the jitted step has
exactly one shape per token bucket (and per sampling variant, see model_runner.py).

Padding: padding tokens read token 0 at position 0 of sequence row 0 and write into the null page;
padding sequence rows sample from token 0 and their results are ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepinfer_jax.config_v4 import v4_table_pages
from deepinfer_jax.models.cache import NULL_PAGE, StepMetadata
from deepinfer_jax.models.decode_kernels import decode_kernel_step
from deepinfer_jax.sampling import SamplingTensors, make_key_data_batch
from deepinfer_jax.types import Request


def placeholder(row: int) -> int:
    """The id standing for "what row `row` of the previous dispatched step samples" (always <= -2;
    -1 stays the padding of id arrays). The runner resolves it on the device."""
    return -row - 2


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def token_buckets(max_num_batched_tokens: int, max_num_seqs: int, min_bucket: int = 16) -> tuple[int, ...]:
    """Powers of two from `min_bucket` up to a bucket that holds max(max_num_batched_tokens, max_num_seqs)."""
    top = next_pow2(max(max_num_batched_tokens, max_num_seqs))
    out, b = [], min(min_bucket, top)
    while b < top:
        out.append(b)
        b *= 2
    out.append(top)
    return tuple(out)


def coarse_token_buckets(max_num_batched_tokens: int, max_num_seqs: int, factor: int = 16,
                         min_bucket: int = 16) -> tuple[int, ...]:
    """A ladder of fewer buckets than `token_buckets`': the first holds every sequence row (a decode step of
    them all), each next is `factor` times the last, up to the bucket that holds max(max_num_batched_tokens,
    max_num_seqs). (16, 256) at 16 sequences and 256 tokens. For small models on a CPU (engine/serving_defaults.py),
    where a step padded to a larger bucket costs little and each bucket's programs take seconds to compile."""
    top = next_pow2(max(max_num_batched_tokens, max_num_seqs))
    out, b = [], min(top, max(min_bucket, next_pow2(max_num_seqs)))
    while b < top:
        out.append(b)
        b *= factor
    out.append(top)
    return tuple(out)


@dataclass(frozen=True)
class Shapes:
    """Static shape facts shared by input building and warm-up."""

    buckets: tuple[int, ...]
    max_num_seqs: int
    max_pages: int
    page_size: int
    max_model_len: int
    max_suppress: int = 8
    # int32 words a row of the allowed-token bitmask (structured output) of the full and mask variants:
    # cdiv(vocab, 32), or 0 for no mask stage.
    mask_words: int = 0
    # entries of the full variant's logit_bias arrays (types.MAX_LOGIT_BIAS), or 0 for no bias stage.
    max_logit_bias: int = 0
    # Speculative decoding: 1 + K, the positions each sequence row samples (its K drafts verified and a bonus);
    # 1 without speculation. Every step then has seq_rows * spec_width sampling rows (one layout a bucket).
    spec_width: int = 1
    # A per-group cache (config_v4.CachePools, DeepSeek-V4): the pools, and each step carries every group's page
    # table and slot mapping (StepMetadata.groups). None: one page table.
    kv_pools: Any = None
    # `deepseek_mtp` speculation: K, the drafts the MTP layer proposes on the device each step (runner/spec_mtp.py);
    # 0 otherwise.
    mtp_drafts: int = 0

    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"step of {num_tokens} tokens exceeds the largest bucket {self.buckets[-1]}")

    def seq_rows(self, bucket: int) -> int:
        return min(bucket, next_pow2(self.max_num_seqs))


@dataclass
class HostStep:
    """A padded step on the host, plus which plan rows sample."""

    meta: StepMetadata  # numpy leaves
    sampling: SamplingTensors  # numpy leaves
    request_ids: list[str]  # row -> request id (real rows only)
    sample_rows: list[int]  # rows whose sampled token is used
    bucket: int
    penalties: bool  # the full sampling variant
    greedy: bool = False  # the greedy variant: every row greedy, no draw (RunnerConfig.greedy_variant)
    spec_width: int = 1  # sampling rows a sequence row (Shapes.spec_width): row r's are r * W .. r * W + W - 1
    masked: bool = False  # the mask variant: the base sampler and the allowed-token bitmask (structured output)

    @property
    def variant(self) -> str:
        """The step program's sampling variant: "full", "mask", "greedy" or "base"."""
        return "full" if self.penalties else "mask" if self.masked else "greedy" if self.greedy else "base"


PAGE_ROWS_MIN = 32  # pages a sequence (mean over the step) above which build_metadata takes PageRows' arrays


class PageRows:
    """Each running request's page ids as an int32 array kept across steps (the runner's, one thread).

    A step's page table needs every sequence's whole page list, but between two steps a request's list
    only grows at its end (ScheduledSeq.page_gen names that lifetime). Converting the lists from Python
    ints every step took 4.54 ms at 128 sequences of 512 pages (a 32K context, on an H200 host's CPU);
    with these arrays only the new page ids are converted (0.81 ms; below PAGE_ROWS_MIN pages a sequence the
    lists are converted, which is cheaper). `__call__(seq)` returns a view of the first
    len(seq.page_ids) entries, which later calls never change; `forget(request_id)` drops a request."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[int, np.ndarray, int]] = {}  # request id -> (page_gen, buffer, filled)

    def __call__(self, seq) -> np.ndarray:
        ids, gen = seq.page_ids, seq.page_gen
        n = len(ids)
        old = self._rows.get(seq.request_id)
        if gen and old is not None and old[0] == gen and old[2] <= n:
            _, buf, have = old
            if n > have:
                if n > len(buf):  # grow by doubling; views handed out keep the old buffer
                    buf = np.concatenate([buf[:have], np.empty(max(n, 2 * len(buf)) - have, np.int32)])
                buf[have:n] = ids[have:n]
        else:
            buf = np.empty(max(n, 8), np.int32)
            buf[:n] = ids
        if gen:
            self._rows[seq.request_id] = (gen, buf, n)
        return buf[:n]

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._rows)


def build_metadata(plan_seqs, shapes: Shapes, bucket: int, mark_context: bool = False,
                   page_rows: PageRows | None = None) -> StepMetadata:
    """The padded step's metadata. `mark_context` (RunnerConfig.prefill_context_variant): a prefill-bucket
    step (more token slots than sequence rows) says whether any of its sequences starts past position 0
    (`StepMetadata.has_context`), so that its program need not decide it on the device. `page_rows`: the
    runner's PageRows, which keep the page ids converted across steps (the same arrays either way).

    Built with whole-array numpy operations over the step's tokens (no per-sequence numpy calls: at 128
    sequences a step that loop cost the host ~1.7 ms); sequence r's tokens fill slots
    starts[r] .. starts[r] + len[r] - 1 in plan order."""
    S = shapes.seq_rows(bucket)
    ps = shapes.page_size
    R = len(plan_seqs)
    lens = np.fromiter((len(seq.token_ids) for seq in plan_seqs), np.int64, R)  # [R]
    first = np.fromiter((seq.start_pos for seq in plan_seqs), np.int64, R)  # [R] first position
    npages = np.fromiter((len(seq.page_ids) for seq in plan_seqs), np.int64, R)  # [R]
    T = int(lens.sum())
    starts = np.cumsum(lens) - lens  # [R] first slot of each sequence
    seq_of = np.repeat(np.arange(R), lens)  # [T] the row of each real token
    pos = (np.arange(T) - starts[seq_of] + first[seq_of]).astype(np.int32)  # [T]
    if (pos // ps >= npages[seq_of]).any():
        raise ValueError("a scheduled sequence's page_ids do not cover all of its positions")
    P = int(npages.sum())
    page_table = np.full((S, shapes.max_pages), NULL_PAGE, np.int32)
    page_row = np.repeat(np.arange(R), npages)
    page_col = np.arange(P) - np.repeat(np.cumsum(npages) - npages, npages)
    if page_rows is None or P <= PAGE_ROWS_MIN * R:  # short lists: converting them is cheaper than a call a row
        page_table[page_row, page_col] = np.fromiter((p for seq in plan_seqs for p in seq.page_ids), np.int32, P)
    else:
        page_table[page_row, page_col] = np.concatenate([page_rows(seq) for seq in plan_seqs])
    token_ids = np.zeros(bucket, np.int32)
    token_ids[:T] = np.fromiter((t for seq in plan_seqs for t in seq.token_ids), np.int32, T)
    positions = np.zeros(bucket, np.int32)
    positions[:T] = pos
    seq_ids = np.zeros(bucket, np.int32)
    seq_ids[:T] = seq_of
    slot_mapping = (NULL_PAGE * ps + np.arange(bucket) % ps).astype(np.int32)  # padding: the null page
    slot_mapping[:T] = page_table[seq_of, pos // ps] * ps + pos % ps
    W = shapes.spec_width
    logits_indices = np.zeros(S * W, np.int32)
    if W == 1:
        logits_indices[:R] = starts + lens - 1
    else:  # row r * W + j: the slot of its j-th verified position (the token before its draft j + 1), j <= drafts
        drafts = np.fromiter((seq.num_draft_tokens for seq in plan_seqs), np.int64, R)  # [R]
        j = np.arange(W)[None, :]
        idx = (starts + lens - 1 - drafts)[:, None] + j  # [R, W]
        logits_indices[: R * W] = np.where(j <= drafts[:, None], idx, 0).ravel()
    meta = StepMetadata(token_ids, positions, seq_ids, slot_mapping, page_table, logits_indices)
    if shapes.kv_pools is not None:
        meta = dataclasses.replace(meta, groups=group_tables(plan_seqs, shapes, S, bucket, seq_of, pos))
    if mark_context and not decode_kernel_step(meta):
        meta = dataclasses.replace(meta, has_context=bool((first > 0).any()))
    return meta


def group_tables(plan_seqs, shapes: Shapes, S: int, bucket: int, seq_of: np.ndarray, pos: np.ndarray) -> tuple:
    """Per cache group of `shapes.kv_pools`: (page_table [S, columns], slot_mapping [bucket]), slots in the group's
    own rows a page (`CacheGroup.rows_per_page`). A compressed group's table holds a sequence's page i at column i
    (pages of max_model_len); a windowed group's is a ring (config_v4.py `v4_table_pages`): its live pages at column
    i % columns, the freed ones (null) left out. A token writes a row of a compressed group (a row per
    `tokens_per_row` tokens) only when it closes the row's window (pos + 1 a multiple of the rate); other tokens,
    and padding, write into the null page."""
    ps, T = shapes.page_size, len(pos)
    step = shapes.buckets[-1] + 2 * shapes.spec_width  # a chunk, its drafts and the MTP's chained positions
    out = []
    for gi, g in enumerate(shapes.kv_pools.groups):
        r, rows, ring = g.tokens_per_row, g.rows_per_page(ps), g.window_tokens is not None
        width = v4_table_pages(g, ps, shapes.max_model_len, step)
        table = np.full((S, width), NULL_PAGE, np.int32)
        for row, seq in enumerate(plan_seqs):
            ids = np.asarray(seq.group_page_ids[gi], np.int32)
            if ring:
                live = np.flatnonzero(ids != NULL_PAGE)
                if len(live) and live[-1] - live[0] >= width:
                    raise ValueError(f"cache group {g.name}: {live[-1] - live[0] + 1} live pages exceed its ring "
                                     f"of {width}")
                table[row, live % width] = ids[live]
            else:
                table[row, : len(ids)] = ids
        slots = (NULL_PAGE * rows + np.arange(bucket) % rows).astype(np.int32)
        w = pos // r
        col = (w // rows) % width if ring else np.minimum(w // rows, width - 1)
        slots[:T] = np.where((pos + 1) % r == 0, table[seq_of, col] * rows + w % rows, NULL_PAGE * rows)
        out.append((table, slots))
    return tuple(out)


def uses_penalties(req: Request) -> bool:
    sp = req.sampling_params
    return sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0


def needs_full_variant(req: Request, mask_variant: bool = False) -> bool:
    """Whether a request needs the step's full variant: penalties (history arrays), logprobs, the
    sort that top-k / top-p take, a logit_bias, or a structured-output grammar (the allowed-token bitmask)
    unless the runner has the mask variant (`mask_variant`), which takes a grammar alone.
    Decided on the host so that the step has no device-side branches."""
    sp = req.sampling_params
    truncates = sp.top_k > 0 or sp.top_p < 1.0  # top_k is stored as 0 when off
    return (uses_penalties(req) or sp.logprobs is not None or (not sp.is_greedy() and truncates)
            or (req.grammar is not None and not mask_variant) or sp.logit_bias is not None)


def fill_masks(plan_seqs, requests: dict[str, Request], st: SamplingTensors) -> int:
    """Fill the allowed-token bitmask row of each sampling seq whose request has a grammar from its matcher's
    allowed next tokens (one call for all of them); the other rows keep theirs (all ones). Returns the rows filled."""
    rows = [(requests[seq.request_id].grammar, row) for row, seq in enumerate(plan_seqs)
            if seq.sample and requests[seq.request_id].grammar is not None]
    if rows:
        type(rows[0][0]).fill_bitmasks(rows, st.allowed_token_bits)
    return len(rows)


def build_sampling(plan_seqs, requests: dict[str, Request], seeds: dict[str, int], shapes: Shapes,
                   bucket: int, penalties: bool, masks: bool = True, masked: bool = False) -> SamplingTensors:
    """Per-row sampling tensors. History arrays and the logit_bias arrays are [S, max_model_len] and
    [S, max_logit_bias] in the penalty (full) variant, else [S, 0]; the allowed-token bitmask is
    [S, shapes.mask_words] in the full variant and in the mask variant (`masked`), else [S, 0]: all ones, and for
    each sampling row of a request with a grammar (Request.grammar) that matcher's allowed next tokens, filled in
    one call (`fill_masks`; `masks` False leaves that to the caller)."""
    S = shapes.seq_rows(bucket)
    L = shapes.max_model_len if penalties else 0
    st = SamplingTensors.defaults(S, prompt_len=L, output_len=L, suppress_len=shapes.max_suppress,
                                  mask_words=shapes.mask_words if penalties or masked else 0,
                                  bias_len=shapes.max_logit_bias if penalties else 0)
    row_seeds, row_steps = [0] * S, [0] * S  # Python ints: any seed (negative, >= 2**64) reduces mod 2**64
    for row, seq in enumerate(plan_seqs):
        req = requests[seq.request_id]
        sp = req.sampling_params
        st.temperature[row] = sp.temperature
        st.top_k[row] = sp.top_k if sp.top_k and sp.top_k > 0 else 0
        st.top_p[row] = sp.top_p
        st.min_p[row] = sp.min_p
        if penalties:
            st.presence_penalty[row] = sp.presence_penalty
            st.frequency_penalty[row] = sp.frequency_penalty
            st.repetition_penalty[row] = sp.repetition_penalty
            p, o = req.prompt_token_ids, req.output_token_ids
            st.prompt_token_ids[row, : len(p)] = p
            st.output_token_ids[row, : len(o)] = o
        if req.num_output_tokens < sp.min_tokens:
            banned = list(sp.stop_token_ids or []) + ([] if sp.ignore_eos else list(req.eos_token_ids))
            banned = banned[: shapes.max_suppress]
            st.suppress_token_ids[row, : len(banned)] = banned
        if sp.logit_bias:
            if not penalties or len(sp.logit_bias) > shapes.max_logit_bias:
                raise ValueError(f"request {seq.request_id}: {len(sp.logit_bias)} logit_bias entries, the step takes "
                                 f"{shapes.max_logit_bias if penalties else 0}")
            n = len(sp.logit_bias)
            st.logit_bias_ids[row, :n] = list(sp.logit_bias)
            st.logit_bias_values[row, :n] = list(sp.logit_bias.values())
        if req.grammar is not None and seq.sample:
            if not (penalties or masked) or not shapes.mask_words:
                raise ValueError(f"request {seq.request_id} has a grammar but the step has no token bitmask")
        row_seeds[row] = seeds[seq.request_id]
        row_steps[row] = seq.num_output_tokens
    if masks:
        fill_masks(plan_seqs, requests, st)
    W = shapes.spec_width
    if W > 1:
        return _spec_rows(st, plan_seqs, requests, row_seeds, row_steps, W, penalties)
    key_data = make_key_data_batch(row_seeds, row_steps)
    return SamplingTensors(**{**st.__dict__, "rng_key_data": key_data.astype(np.uint32)})


def _spec_rows(st: SamplingTensors, plan_seqs, requests, row_seeds, row_steps, W: int,
               penalties: bool) -> SamplingTensors:
    """Sequence rows' tensors [S, ...] -> sampling rows [S * W, ...] (Shapes.spec_width): row r * W + j samples
    the sequence's output token num_output_tokens + j, verifying draft j + 1 (-1: none, the bonus position).
    Each row's key, output history and min_tokens suppression are those of that token, as if the drafts
    before it were sampled. Whole-array numpy over the rows (the penalty histories alone a row at a time): the
    host builds these between two steps' device work (docs/speculative.md)."""
    fields = {name: (None if v is None else np.repeat(v, W, axis=0)) for name, v in st.__dict__.items()}
    S, R = len(row_seeds), len(plan_seqs)
    drafts = np.full((S, W), -1, np.int32)
    nd = np.fromiter((seq.num_draft_tokens for seq in plan_seqs), np.int64, R)  # [R]
    if nd.any():
        flat = np.fromiter((t for seq in plan_seqs if seq.num_draft_tokens
                            for t in seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens:]), np.int32, int(nd.sum()))
        drafts[np.repeat(np.arange(R), nd), np.arange(len(flat)) - np.repeat(np.cumsum(nd) - nd, nd)] = flat
    reqs = [requests[seq.request_id] for seq in plan_seqs]
    n_out = np.fromiter((req.num_output_tokens for req in reqs), np.int64, R)  # [R]
    min_tokens = np.fromiter((req.sampling_params.min_tokens for req in reqs), np.int64, R)
    j = np.arange(W)[None, :]
    free = (j >= 1) & (n_out[:, None] + j >= min_tokens[:, None])  # [R, W]: rows past min_tokens suppress nothing
    fields["suppress_token_ids"][: R * W][free.ravel()] = -1
    if penalties:
        hist = fields["output_token_ids"]
        for r in range(R):
            n, d = int(n_out[r]), drafts[r, : nd[r]]
            for k in range(1, min(W, len(d) + 1)):
                hist[r * W + k, n: n + k] = d[:k]
    seeds = np.repeat(np.fromiter((int(s) % (1 << 64) for s in row_seeds), np.uint64, S), W)
    steps = (np.repeat(np.asarray(row_steps, np.int64), W).reshape(S, W) + np.arange(W)).ravel()
    key_data = make_key_data_batch(seeds, steps)
    fields.update(rng_key_data=key_data.astype(np.uint32), draft_token_ids=drafts.ravel())
    return SamplingTensors(**fields)
