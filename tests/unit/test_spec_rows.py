"""A speculative step's host layout (runner/inputs.py, Shapes.spec_width = K + 1): sequence row r's K + 1 sampling
rows read the logits of its verified positions and check its drafts; each row's key, output history and
min_tokens suppression are those of the token it samples; and the host keeps a sequence's tokens up to its first
rejected row (runner/step_io.py: step_result)."""

from __future__ import annotations

import types

import numpy as np

from deepinfer_jax.runner.inputs import HostStep, Shapes, build_metadata, build_sampling
from deepinfer_jax.runner.step_io import step_result
from deepinfer_jax.sampling import make_key_data_batch
from deepinfer_jax.scheduler.scheduler import ScheduledSeq
from deepinfer_jax.types import Request, SamplingParams

W = 3  # K = 2


def _seq(rid, tokens, start, drafts, pages, outputs):
    return ScheduledSeq(rid, tokens, start, pages, True, outputs, num_draft_tokens=drafts)


def test_rows_positions_drafts_keys_and_histories():
    shapes = Shapes(buckets=(16,), max_num_seqs=4, max_pages=4, page_size=4, max_model_len=16, max_suppress=2,
                    spec_width=W)
    a = Request("a", [5, 6, 7], SamplingParams(repetition_penalty=1.2, min_tokens=3), eos_token_ids=(1,))
    a.output_token_ids = [8, 9]
    b = Request("b", [4, 4], SamplingParams())
    seqs = [_seq("a", [9, 20, 21], 4, 2, [1, 2], 2),  # last token 9 at position 4, drafts 20 and 21
            _seq("b", [4, 4], 0, 0, [3], 0)]  # a prefill that samples: no drafts
    meta = build_metadata(seqs, shapes, 16)
    assert meta.logits_indices[:2 * W].tolist() == [0, 1, 2, 4, 0, 0]  # b's rows past the first: padding
    st = build_sampling(seqs, {"a": a, "b": b}, {"a": 7, "b": 8}, shapes, 16, penalties=True)
    assert st.draft_token_ids[:2 * W].tolist() == [20, 21, -1, -1, -1, -1]
    want = make_key_data_batch([7, 7, 7, 8, 8, 8], [2, 3, 4, 0, 1, 2])
    assert (st.rng_key_data[:2 * W] == want).all()
    hist = st.output_token_ids
    assert hist[0, :3].tolist() == [8, 9, -1] and hist[1, :3].tolist() == [8, 9, 20]
    assert hist[2, :4].tolist() == [8, 9, 20, 21]
    # min_tokens 3: output token 2 (row 0) holds EOS back, tokens 3 and 4 (rows 1, 2) do not
    assert st.suppress_token_ids[0].tolist() == [1, -1] and (st.suppress_token_ids[1:3] == -1).all()


def test_host_keeps_tokens_up_to_the_first_rejected_row():
    host = HostStep(None, None, ["a", "b", "c"], [0, 1, 2], 16, True, spec_width=W)
    sampled = types.SimpleNamespace(
        token_ids=np.array([20, 21, 30, 40, 41, 42, 50, 51, 52]),
        accepted=np.array([1, 1, 0, 0, 1, 0, 1, 0, 0]),
        logprob=np.arange(9, dtype=np.float32), top_logprob_ids=np.zeros((9, 0), np.int32),
        top_logprobs=np.zeros((9, 0), np.float32), drafts=None)  # no MTP drafts (SampleOutput.drafts)
    res = step_result(host, sampled)
    assert res.spec_token_ids == {"a": [20, 21, 30], "b": [40], "c": [50, 51]}
    assert res.token_ids == {"a": 30, "b": 40, "c": 51}
    assert [lp[0] for lp in res.spec_logprobs["a"]] == [0.0, 1.0, 2.0]


def test_data_parallel_ranks_lay_out_their_verify_rows_rank_after_rank():
    """Two data-parallel ranks (sharding/data_parallel.py merge_rank_steps): rank r's sampling rows start at
    r x seq_rows x W and read its own tokens (r x bucket on); its draft ids, keys and the MTP's next_token_ids stay
    with its rows; step_result then gives each rank's sequence its own accepted tokens."""
    import dataclasses

    from deepinfer_jax.runner.spec_mtp import next_token_ids
    from deepinfer_jax.sharding.data_parallel import merge_rank_steps

    shapes = Shapes(buckets=(8,), max_num_seqs=2, max_pages=4, page_size=4, max_model_len=16, spec_width=W)
    reqs = {"a": Request("a", [5, 6, 7], SamplingParams()), "b": Request("b", [4, 4, 4, 4], SamplingParams())}
    groups = [[_seq("a", [9, 20, 21], 4, 2, [1, 2], 1)],  # rank 0: last token 9 at position 4, drafts 20 and 21
              [_seq("b", [3, 30], 5, 1, [1, 2], 2)]]  # rank 1: last token 3 at position 5, draft 30
    metas = [dataclasses.replace(build_metadata(g, shapes, 8), next_token_ids=next_token_ids(g, reqs, 2))
             for g in groups]
    sts = [build_sampling(g, reqs, {"a": 7, "b": 8}, shapes, 8, penalties=False) for g in groups]
    meta, st, rids, rows = merge_rank_steps(metas, sts, groups, 8, shapes.seq_rows(8))
    S = shapes.seq_rows(8)  # 2 sequence rows a rank, 2 x W sampling rows
    assert meta.logits_indices.tolist() == [0, 1, 2, 0, 0, 0] + [8, 9, 8, 8, 8, 8]
    assert st.draft_token_ids.tolist() == [20, 21, -1, -1, -1, -1] + [30, -1, -1, -1, -1, -1]
    assert (st.rng_key_data[S * W: S * W + 2] == make_key_data_batch([8, 8], [2, 3])).all()
    assert meta.next_token_ids.tolist() == [-1, -2, -1, -2]
    assert rids == ["a", None, "b", None] and rows == [0, 2]
    host = HostStep(meta, st, rids, rows, 8, False, spec_width=W)
    sampled = types.SimpleNamespace(token_ids=np.arange(4 * W) + 100, accepted=np.array([1, 0, 0] * 2 + [1, 0, 0] * 2),
                                    drafts=None)
    assert step_result(host, sampled).spec_token_ids == {"a": [100, 101], "b": [106, 107]}


def test_each_row_is_the_plain_row_of_the_token_it_samples():
    """Random plans (drafts 0..K, min_tokens around the outputs, any seeds): sampling row r * W + j equals the plain
    step's row (spec_width 1) for sequence r with its first j drafts already sampled: its key, min_tokens
    suppression and output history; its draft id is draft j + 1."""
    import dataclasses

    rng = np.random.default_rng(0)
    L = 24
    wide = Shapes(buckets=(64,), max_num_seqs=8, max_pages=6, page_size=4, max_model_len=L, max_suppress=2,
                  spec_width=W)
    plain = dataclasses.replace(wide, spec_width=1)
    for _ in range(20):
        reqs, seqs, seeds = {}, [], {}
        for i in range(int(rng.integers(1, 7))):
            rid = str(i)
            n_out = int(rng.integers(0, 6))
            sp = SamplingParams(repetition_penalty=1.1, min_tokens=int(rng.integers(0, 9)))
            reqs[rid] = Request(rid, [5, 6], sp, eos_token_ids=(1,), output_token_ids=rng.integers(2, 50, n_out).tolist())
            seeds[rid] = int(rng.choice([-3, 7, 2**40 + 1, 2**64 + 5]))
            nd = int(rng.integers(0, W))
            drafts = rng.integers(2, 50, nd).tolist()
            seqs.append(ScheduledSeq(rid, [9] + drafts, 2 + n_out - 1, [1, 2, 3, 4], True, n_out, num_draft_tokens=nd))
        st = build_sampling(seqs, reqs, seeds, wide, 64, penalties=True)
        for r, seq in enumerate(seqs):
            d = seq.token_ids[1:]
            for j in range(W):
                row = r * W + j
                assert st.draft_token_ids[row] == (d[j] if j < len(d) else -1)
                if j > len(d):
                    continue  # past the bonus position: nothing sampled there
                req = reqs[seq.request_id]
                ahead = Request(req.request_id, req.prompt_token_ids, req.sampling_params, eos_token_ids=(1,),
                                output_token_ids=req.output_token_ids + d[:j])
                one = build_sampling([dataclasses.replace(seq, num_output_tokens=seq.num_output_tokens + j)],
                                     {seq.request_id: ahead}, seeds, plain, 64, penalties=True)
                assert (st.rng_key_data[row] == one.rng_key_data[0]).all()
                assert (st.suppress_token_ids[row] == one.suppress_token_ids[0]).all()
                assert (st.output_token_ids[row] == one.output_token_ids[0]).all()
