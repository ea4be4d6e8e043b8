"""All-to-all expert dispatch (--all2all-backend all_to_all, models/moe_a2a.py) against the all-gather form and
the single-device code: one MoE layer's output under DP2 x EP4, DP4 x EP4, DP8 x EP8 and EP4 over TP4 alone (70
tokens: padded), with the model's routing (the whole MoE block), a balanced routing (the smallest buffer of the
capacity ladder) and a skewed one (every token to one device: the dropless worst case); an EPLB placement with
redundant experts changes no output; and through the engine, all-to-all with EPLB gives HF transformers' greedy
tokens, counts the expert load on the device and rebalances from it with the same tokens. fp32, 8 fake CPU devices, each script in its own process (run_moe_dispatch.py, SCRIPT)."""

from __future__ import annotations

import json
import os

import pytest

from hf_models import hf_greedy, random_prompts
from _runs import REPO, run_all

HERE = os.path.join(REPO, "tests", "sharding")
# LLM with all-to-all dispatch and EPLB (8 redundant experts placed from skewed counts: 24 physical, 3 a device),
# DP4 x EP8 (TP2: tokens sliced over "tensor" before dispatch); the all-gather form with a placement and the
# all-to-all without one: run_moe_dispatch.py
SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[4])
from run_case import collectives  # sets 8 fake CPU devices before JAX starts
from deepinfer_jax import LLM, SamplingParams
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[2])]
llm = LLM(sys.argv[1], dtype="float32", skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4,
          max_num_batched_tokens=32, token_buckets=(32,), page_size=8, progress=False, compilation_cache_dir=None,
          tensor_parallel_size=2, data_parallel_size=4, enable_expert_parallel=True, all2all_backend="all_to_all",
          enable_eplb=True, eplb_config={"num_redundant_experts": 8, "expert_load": sys.argv[3]})
greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
res = llm.generate(prompts, greedy)
eng = llm.engine
replicas, load = llm.eplb_placement.replicas.tolist(), llm.expert_load()
from deepinfer_jax.server.metrics import ServerMetrics  # /metrics's registry on the engine's report
metrics = ServerMetrics("m").render(None, 0, None, llm.engine.expert_load_report()).decode()
rebalanced = llm.rebalance_experts()  # a placement from the observed counts, then the same prompts again
again = llm.generate(prompts, greedy)
import asyncio, types, aiohttp  # POST /admin/rebalance_experts on a real server over this engine, on 127.0.0.1
from deepinfer_jax.cli import _serve_parser
from deepinfer_jax.server.app import start_server
async def admin():
    ns = _serve_parser().parse_args(["--model", sys.argv[1], "--host", "127.0.0.1", "--port", "0"])
    srv = await start_server(ns, build=lambda: eng, tokenizer=types.SimpleNamespace())
    await asyncio.get_running_loop().run_in_executor(None, srv.engine.wait_ready, 60)
    async with aiohttp.ClientSession(srv.url) as c:
        async with c.post("/admin/rebalance_experts") as r:
            out = {"status": r.status, "body": await r.json()}
    await srv.shutdown()
    return out
served = asyncio.run(admin())
served["balancedness_now"] = eng.expert_load_report()["balancedness"]
print("RESULT " + json.dumps({"tokens": [o.outputs[0].token_ids for o in res],
                              "replicas": replicas, "load": load["load"].tolist(),
                              "per_expert": load["per_expert"].tolist(), "rebalanced": rebalanced,
                              "balancedness": load["balancedness"], "metrics": metrics,
                              "tokens_after": [o.outputs[0].token_ids for o in again],
                              "replicas_after": llm.eplb_placement.replicas.tolist(),
                              "late_compiles": eng.runner.compiles_after_warmup, "served": served,
                              "collectives": collectives(eng.runner.programs.executables.values()),
                              "bucket": 32, "seq_rows": eng.shapes.seq_rows(32)}))
"""
LENGTHS, MAX_TOKENS = (3, 17, 40, 9, 24, 1), 6


@pytest.fixture(scope="module")
def runs(hf_case, tmp_path_factory):
    model, path = hf_case("v3_grouped_noaux")
    load = tmp_path_factory.mktemp("eplb") / "load.json"
    load.write_text(json.dumps([1000.0 / (1 + e) ** 1.5 for e in range(model.config.n_routed_experts)]))  # 0-2 hot
    prompts = random_prompts(1, LENGTHS, model.config.vocab_size)
    out = run_all({"layer": [os.path.join(HERE, "run_moe_dispatch.py")],
                   "engine": ["-c", SCRIPT, path, json.dumps(prompts), str(load), HERE]})
    return out["layer"], (prompts, out["engine"])


def test_all_to_all_equals_all_gather_and_one_device(runs):
    res = runs[0]
    layouts = sorted({k.split("/")[0] for k in res if "/a2a/balanced" in k})
    assert len(layouts) == 4
    for lay in layouts:
        assert res[f"{lay}/a2a/hlo_all_to_all"] and not res[f"{lay}/gather/hlo_all_to_all"], lay
        # the whole MoE block (routing, routed and shared experts): both forms equally close to one device
        assert res[f"{lay}/a2a/block"] < 1e-5 and res[f"{lay}/gather/block"] < 1e-5, lay
        for routing in ("balanced", "skewed"):
            assert res[f"{lay}/a2a/{routing}"] < 1e-5, (lay, routing, res[f"{lay}/a2a/{routing}"])


def test_eplb_placement_never_changes_the_output(runs):
    """8 redundant slots (24 physical experts), placed flat and rebalanced for skewed counts (sharding/eplb.py):
    on one device and under both dispatch forms, the MoE block's output is the logical experts' on one device,
    and the two placements run in one compiled program."""
    res = runs[0]
    cases = [k for k in res if "/eplb_" in k and not k.endswith("compiles")]
    assert len(cases) == 2 * 3 * 2
    for key in cases:
        assert res[key] < 1e-5, (key, res[key])
    assert all(res[k] == 1 for k in res if k.endswith("eplb_compiles"))


def test_all_to_all_with_eplb_greedy_equals_hf(runs, hf_case):
    """LLM(all2all_backend="all_to_all", enable_eplb=True, eplb_config={"num_redundant_experts": 8, "expert_load":
    skewed counts}): the hot experts get the copies, and greedy tokens are HF's."""
    model, _ = hf_case("v3_grouped_noaux")
    prompts, r = runs[1]
    assert r["tokens"] == [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    assert r["late_compiles"] == 0
    per_layer = r["replicas"][0]
    assert sum(per_layer) == model.config.n_routed_experts + 8 and per_layer[0] == max(per_layer) > 1


def test_eplb_counts_the_load_and_rebalances_without_changing_tokens(runs, hf_case):
    """The load counted on the device (every MoE layer, padding left out): each real token processed, the prompts'
    and the 5 fed back of each request, routed to k experts; `rebalance_experts` places the experts for those
    counts, with a lower largest rank load on them, in the compiled programs, and greedy tokens stay HF's."""
    model, _ = hf_case("v3_grouped_noaux")
    prompts, r = runs[1]
    k, tokens = model.config.num_experts_per_tok, sum(LENGTHS) + (MAX_TOKENS - 1) * len(LENGTHS)
    assert [sum(row) for row in r["load"]] == [tokens * k] * len(r["load"])
    assert r["per_expert"] == [sum(col) for col in zip(*r["load"])]
    lines = dict(line.rsplit(" ", 1) for line in r["metrics"].splitlines() if line.startswith("deepinfer:eplb"))
    assert [float(lines[f'deepinfer:eplb_expert_load_total{{expert="{e}",model_name="m"}}'])
            for e in range(len(r["per_expert"]))] == r["per_expert"]
    assert float(lines['deepinfer:eplb_balancedness{model_name="m"}']) == pytest.approx(r["balancedness"])
    assert 0 < r["balancedness"] <= 1
    rb = r["rebalanced"]
    assert rb["applied"] and rb["max_rank_load_after"] < rb["max_rank_load_before"], rb
    assert rb["balancedness_after"] > rb["balancedness_before"], rb
    assert r["replicas_after"] != r["replicas"]
    assert r["tokens_after"] == r["tokens"] and r["late_compiles"] == 0


def test_rebalance_experts_over_http(runs):
    """POST /admin/rebalance_experts on a real server (127.0.0.1) over the EPLB engine: runs the rebalance between
    steps and answers its figures as JSON; the engine's placement is then the one they describe (the new one where
    applied, else the old)."""
    r = runs[1][1]["served"]
    assert r["status"] == 200, r
    body = r["body"]
    assert set(body) == {"applied", "max_rank_load_before", "max_rank_load_after", "balancedness_before",
                         "balancedness_after"}, body
    assert 0 < body["balancedness_after"] <= 1
    assert body["applied"] == (body["max_rank_load_after"] < body["max_rank_load_before"])
    want = body["balancedness_after"] if body["applied"] else body["balancedness_before"]
    assert r["balancedness_now"] == pytest.approx(want)


def test_all_to_all_collectives_are_the_predicted_ones(runs, hf_case):
    """The compiled step's routed-expert collectives are those sharding/comm.py predicts: its worst case, one
    all-to-all a ladder rung, and no reduce-scatter."""
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.models.moe_a2a import capacity_ladder
    from deepinfer_jax.sharding import ParallelConfig
    from deepinfer_jax.sharding.comm import step_collectives

    model, _ = hf_case("v3_grouped_noaux")
    r = runs[1][1]
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    got = {(k, tuple(d)) for k, d in r["collectives"]}
    want = {(c.kind, c.shape) for c in step_collectives(cfg, ParallelConfig(2, 4, True, all2all_backend="all_to_all"), r["bucket"],
                                                        r["seq_rows"], 4) if c.what.startswith("routed experts")}
    assert want <= got, f"predicted {sorted(want - got)} not compiled"
    Ts, D, k = r["bucket"] // 2, cfg.hidden_size, cfg.num_experts_per_tok
    assert {d for kind, d in got if kind == "all-to-all"} == {(1, c, n) for c in capacity_ladder(Ts) for n in (D, k)}
    assert not any(kind == "reduce-scatter" for kind, _ in got)
