"""The admin routes over raw HTTP on the shared live server (EPLB off there): POST /admin/rebalance_experts answers
in OpenAI's error shape, naming --enable-eplb, and asks for the API key as /v1/* does. Its success path runs on an
EPLB engine under expert parallelism in tests/sharding/test_moe_dispatch.py."""

from __future__ import annotations

from test_errors import assert_error, post


def test_rebalance_experts_without_eplb_names_the_flag(server):
    status, _, text = post(server, "/admin/rebalance_experts", {})
    err = assert_error(status, text, 400)
    assert "--enable-eplb" in err["message"] and err["code"] == "eplb_disabled"


def test_rebalance_experts_needs_the_api_key(server):
    status, _, text = post(server, "/admin/rebalance_experts", {}, headers={"Authorization": "Bearer wrong"})
    assert assert_error(status, text, 401)["code"] == "invalid_api_key"
