"""`deepinfer chat` (interactive, streaming) and `deepinfer generate` (one shot), on an in-process engine.

Both drive LLMEngine step by step on the main thread (no HTTP). Chat keeps the conversation, renders
it with the model's chat template and splits reasoning (`<think>...</think>`, deepseek_r1 rules) from
the answer: reasoning is printed dim grey, the answer normally. Ctrl-C stops the current answer;
Ctrl-D or /exit leaves; /reset starts a new conversation.

Usage errors are one line (server/args.py ArgParser, check_engine_args), and so is bad input found while the
engine is built (a ValueError or OSError: exit status 1; DEEPINFER_DEBUG=1 shows its traceback). Messages and
progress bars go to stderr, the model's text alone to stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

DIM, RESET = "\x1b[2m", "\x1b[0m"


def _parser(cmd: str) -> argparse.ArgumentParser:
    from deepinfer_jax.server.args import ArgParser, add_engine_args, fraction, nonnegative_float, positive_int

    p = ArgParser(prog=f"deepinfer {cmd}")
    add_engine_args(p)
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=positive_int, default=512 if cmd == "chat" else 64)
    g.add_argument("--temperature", type=nonnegative_float, default=0.6 if cmd == "chat" else 0.0)
    g.add_argument("--top-p", type=fraction, default=0.95 if cmd == "chat" else 1.0)
    g.add_argument("--no-color", action="store_true", help="do not dim the reasoning")
    if cmd == "chat":
        g.add_argument("--system", default=None, help="system prompt")
    else:
        g.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
        g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
        g.add_argument("--ignore-eos", action="store_true")
    return p


def _load(ns):
    from deepinfer_jax.engine.llm import LLM
    from deepinfer_jax.server.args import DEFAULT_MODEL_NOTE, engine_kwargs, resolve_model, show_progress

    model_dir, _ = resolve_model(ns)
    if not ns.model:
        print(f"no --model given: using {DEFAULT_MODEL_NOTE}", file=sys.stderr)
    kw, note = engine_kwargs(ns, progress=show_progress())
    if note:
        print(note, file=sys.stderr)
    print(f"loading {model_dir} ...", file=sys.stderr, flush=True)
    return LLM(model_dir, **kw)


class _Printer:
    """Writes reasoning dim and content plain, with a label when switching between them. Whitespace at the
    start and end of each part (the newlines around <think>...</think>) is not printed: one line break
    separates reasoning from content."""

    def __init__(self, color: bool):
        self.color, self.mode, self.held = color, None, ""

    def _part(self, text: str) -> str:
        """`text` less leading whitespace at the start of a part, with trailing whitespace held back until
        more text follows."""
        text = self.held + text
        if self.fresh:
            text = text.lstrip()
            self.fresh = not text
        body = text.rstrip()
        self.held = text[len(body):]
        return body

    def write(self, reasoning: str, content: str) -> None:
        if reasoning:
            if self.mode != "r":
                sys.stdout.write((DIM if self.color else "") + ("" if self.color else "[thinking] "))
                self.mode, self.fresh, self.held = "r", True, ""
            sys.stdout.write(self._part(reasoning))
        if content:
            if self.mode != "c":
                if self.mode == "r":
                    sys.stdout.write((RESET if self.color else "") + "\n")
                self.mode, self.fresh, self.held = "c", True, ""
            sys.stdout.write(self._part(content))
        sys.stdout.flush()

    def end(self) -> None:
        if self.mode == "r" and self.color:
            sys.stdout.write(RESET)
        sys.stdout.write("\n")
        sys.stdout.flush()
        self.mode, self.held = None, ""


def stream_one(llm, ids: list[int], prompt_text: str, params, printer: _Printer | None):
    """Run one request to the end on the engine, printing deltas; returns (reasoning, content, output)."""
    from deepinfer_jax.text import get_reasoning_parser, prompt_opens_reasoning

    eng = llm.engine
    rp = get_reasoning_parser("deepseek_r1")(starts_in_reasoning=prompt_opens_reasoning(prompt_text))
    rid = eng.new_request_id()
    eng.add_request(rid, ids, params, prompt=prompt_text, keep_special_tokens=rp.special_tokens)
    sent, parts_r, parts_c, last = 0, [], [], None
    try:
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.request_id != rid:
                    continue
                last = out
                text = out.outputs[0].text
                r, c = rp.feed(text[sent:])
                sent = len(text)
                parts_r.append(r)
                parts_c.append(c)
                if printer:
                    printer.write(r, c)
    except KeyboardInterrupt:
        eng.abort_request(rid)
        if printer:
            printer.write("", " [stopped]")
    r, c = rp.flush()
    parts_r.append(r)
    parts_c.append(c)
    if printer:
        printer.write(r, c)
        printer.end()
    return "".join(parts_r), "".join(parts_c), last


def chat(ns) -> int:
    return _chat(ns, _load(ns))


def _chat(ns, llm) -> int:
    from deepinfer_jax.types import SamplingParams

    tok, eng = llm.tokenizer, llm.engine
    color = sys.stdout.isatty() and not ns.no_color
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p)
    base = [{"role": "system", "content": ns.system}] if ns.system else []
    history = list(base)
    print("chat with the model (/reset, /exit, Ctrl-D to leave)", file=sys.stderr)
    if not ns.model:
        from deepinfer_jax.server.args import DEFAULT_MODEL_TRY

        print(DEFAULT_MODEL_TRY, file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = list(base)
            continue
        history.append({"role": "user", "content": line})
        text = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        room = eng.max_model_len - len(ids)
        if room < 1:
            print(f"the conversation ({len(ids)} tokens) no longer fits max_model_len {eng.max_model_len}; "
                  "use /reset", file=sys.stderr)
            history.pop()
            continue
        import dataclasses

        p = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
        _, content, _ = stream_one(llm, ids, text, p, _Printer(color))
        history.append({"role": "assistant", "content": content})


def generate(ns) -> int:
    from deepinfer_jax.types import SamplingParams

    llm = _load(ns)
    tok = llm.tokenizer
    color = sys.stdout.isatty() and not ns.no_color
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            ignore_eos=ns.ignore_eos)
    for i, prompt in enumerate(ns.prompt):
        if ns.chat:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           tokenize=False)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            text, ids = prompt, tok.encode(prompt)
        if len(ns.prompt) > 1:
            print(f"--- prompt {i}: {prompt!r}")
        try:
            stream_one(llm, ids, text if ns.chat else "", params, _Printer(color))
        except ValueError as e:
            print(f"deepinfer generate: error: --prompt number {i + 1}: {e}", file=sys.stderr)
            return 2
    return 0


def main(cmd: str, argv: list[str]) -> int:
    """Run `deepinfer chat` / `generate`, then end the process with its exit code, its output flushed, without the
    interpreter's teardown: the runtime's native threads, torn down there, can abort a finished command
    ("terminate called without an active exception", exit code 134), even after the engine was collected."""
    rc = _main(cmd, argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _main(cmd: str, argv: list[str]) -> int:
    from deepinfer_jax.server.args import check_engine_args

    parser = _parser(cmd)
    ns = check_engine_args(parser, parser.parse_args(argv))
    try:
        return chat(ns) if cmd == "chat" else generate(ns)
    except (ValueError, OSError) as e:  # bad input found while building the engine (ConfigError is a ValueError)
        if os.environ.get("DEEPINFER_DEBUG"):
            raise
        print(f"deepinfer {cmd}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"deepinfer {cmd}: interrupted", file=sys.stderr)
        return 130
