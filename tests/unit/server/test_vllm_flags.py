"""vLLM 0.26.0's `vllm serve` flags against deepinfer serve's parser: each is the same flag, an accepted
no-op, or refused with a line naming it; docs/from-vllm.md holds the same table."""

from __future__ import annotations

import os

import pytest

from deepinfer_jax.cli import _serve_parser
from deepinfer_jax.server import vllm_flags as vf
from deepinfer_jax.server.args import check_engine_args, parse_with_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
VLLM = {line.split()[0]: line.split()[1:]
        for line in open(os.path.join(ROOT, "tests", "data", "vllm-0.26.0-serve-flags.txt")) if line.strip()}


@pytest.fixture(scope="module")
def parser():
    return _serve_parser()


def test_every_vllm_flag_is_classified_once():
    groups = [vf.SAME, set(vf.NOOP), set(vf.NOT_YET), set(vf.REFUSED)]
    for i, a in enumerate(groups):
        for b in groups[i + 1:]:
            assert not a & b, a & b
    table = set().union(*groups)
    assert table - set(VLLM) == set(), "flags in the table that vLLM 0.26.0 does not have"
    assert set(VLLM) - table == set(), "vLLM flags missing from the table"


def test_same_flags_exist_with_vllms_short_names(parser):
    options = parser._option_string_actions
    for flag in vf.SAME:
        assert flag in options, flag
        for short in VLLM[flag]:
            assert short in options, (flag, short)
    ns = parser.parse_args(["/models/x", "-tp", "2", "-ep", "--num-gpu-blocks-override", "100"])
    assert (ns.model_tag, ns.tensor_parallel_size, ns.enable_expert_parallel, ns.num_pages) == ("/models/x", 2, True, 100)


def test_noop_flags_are_accepted_and_say_so(parser):
    help_text = parser.format_help()
    for flag, why in vf.NOOP.items():
        argv = [flag] if flag in vf.NOOP_BOOLEAN else [flag, "x"]
        parser.parse_args(argv)
        assert flag in help_text
    assert help_text.count("no-op:") == len(vf.NOOP)
    for flag in vf.OLD_NOOP:  # older vLLM's, not in 0.26.0's list
        assert flag not in VLLM and parser.parse_args([flag]) and flag in help_text


def test_refused_flags_name_themselves(parser, capsys):
    refused = {**vf.REFUSED, **vf.NOT_YET}
    for flag in refused:
        for name in [flag] + VLLM[flag]:
            with pytest.raises(SystemExit) as e:
                parser.parse_args([name, "1"])
            assert e.value.code == 2
            err = capsys.readouterr().err
            assert err.startswith(f"deepinfer serve: error: argument {name}: ") and err.count("\n") == 1, err
            assert ("not yet" in err) == (flag in vf.NOT_YET)
    for flag in vf.NOOP_BOOLEAN - vf.NOOP_NO_FORM_OK:  # the --no- forms would ask for something else
        with pytest.raises(SystemExit):
            parser.parse_args(["--no-" + flag[2:]])
        assert f"argument --no-{flag[2:]}: not supported" in capsys.readouterr().err
    parser.parse_args(["--no-trust-remote-code"])


def test_refused_in_yaml_too(parser, tmp_path, capsys):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("enforce_eager: true\n")
    with pytest.raises(SystemExit):
        parse_with_config(parser, ["--config", str(cfg)])
    assert "enforce_eager: not supported: every step is a compiled XLA program" in capsys.readouterr().err
    cfg.write_text("trust_remote_code: true\nenable_chunked_prefill: true\n")
    assert parse_with_config(parser, ["--config", str(cfg)]).trust_remote_code is True


def test_auto_tool_choice_needs_a_parser(parser, capsys):
    with pytest.raises(SystemExit):
        check_engine_args(parser, parser.parse_args(["--enable-auto-tool-choice"]))
    assert "--enable-auto-tool-choice: requires --tool-call-parser" in capsys.readouterr().err
    ns = check_engine_args(parser, parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v3"]))
    assert ns.enable_auto_tool_choice
    with pytest.raises(SystemExit):
        check_engine_args(parser, parser.parse_args(["/a", "--model", "/b"]))
    assert "given twice" in capsys.readouterr().err


def test_docs_hold_the_table():
    with open(os.path.join(ROOT, "docs", "from-vllm.md"), encoding="utf-8") as f:
        page = f.read()
        assert vf.markdown_table() in page, "docs/from-vllm.md: paste vllm_flags.markdown_table() into it"
        assert vf.old_flags_markdown() in page, "docs/from-vllm.md: paste vllm_flags.old_flags_markdown() into it"
