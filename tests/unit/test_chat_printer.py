"""`deepinfer chat`'s printer: reasoning then content, one line break between them, whatever the deltas."""

from __future__ import annotations

from deepinfer_jax.server.terminal import _Printer


def _run(parts, capsys) -> str:
    p = _Printer(color=False)
    for r, c in parts:
        p.write(r, c)
    p.end()
    return capsys.readouterr().out


def test_reasoning_and_answer_without_blank_lines(capsys):
    # what the deepseek_r1 parser yields for "<think>\n7 + 8 = 15.\n</think>\n\n37 + 48 = 85." in deltas
    parts = [("\n", ""), ("7 + 8", ""), (" = 15.", ""), ("\n", ""), ("", "\n"), ("", "\n37 + 48"), ("", " = 85.")]
    assert _run(parts, capsys) == "[thinking] 7 + 8 = 15.\n37 + 48 = 85.\n"


def test_inner_whitespace_is_kept(capsys):
    parts = [("", "Hello"), ("", " "), ("", "\n"), ("", "there."), ("", "\n")]
    assert _run(parts, capsys) == "Hello \nthere.\n"
    assert _run([("", "[stopped]")], capsys) == "[stopped]\n"
