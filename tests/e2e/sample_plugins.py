"""Two real plugins for the plugin tests (docs/plugins.md), and one that fails on purpose.

PIIRedactor (blocking: its regexes run on the text threads) rewrites e-mail addresses and phone numbers in
chat messages and completion prompts before tokenizing, refuses a request that holds a card number, and adds
a route reporting what it did. ProfanityFilter masks banned phrases in the output, also when a phrase is
split over several streamed deltas: it holds back the tail that could still start one.
"""

from __future__ import annotations

import re
import threading

from aiohttp import web

from deepinfer_jax.server.plugins import Plugin, Reject

EMAIL = re.compile(r"[\w.+-]+@[\w-]+\.[\w.]+")
PHONE = re.compile(r"\+?\d[\d -]{7,}\d")
CARD = re.compile(r"\b(?:\d[ -]?){13,16}\b")


class PIIRedactor(Plugin):
    name = "pii-redactor"
    blocking = True

    def __init__(self):
        self.redacted = 0
        self.threads: set[str] = set()

    def _clean(self, text: str) -> str:
        if CARD.search(text):
            raise Reject("the request holds a payment card number; remove it", code="pii_rejected")
        text, n1 = EMAIL.subn("[email]", text)
        text, n2 = PHONE.subn("[phone]", text)
        self.redacted += n1 + n2
        return text

    def on_request(self, ctx, body):
        self.threads.add(threading.current_thread().name)
        if isinstance(body.get("messages"), list):
            for m in body["messages"]:
                if isinstance(m, dict) and isinstance(m.get("content"), str):
                    m["content"] = self._clean(m["content"])
        p = body.get("prompt")
        if isinstance(p, str):
            body["prompt"] = self._clean(p)
        elif isinstance(p, list) and all(isinstance(x, str) for x in p):
            body["prompt"] = [self._clean(x) for x in p]
        return body

    def routes(self):
        async def stats(request):
            return web.json_response({"redacted": self.redacted, "threads": sorted(self.threads)})

        return [web.get("/plugins/pii-redactor", stats)]


class ProfanityFilter(Plugin):
    name = "profanity-filter"

    def __init__(self, banned=("weather.</think>I will", "check the")):
        self.banned = [b.lower() for b in banned]
        self.longest = max(len(b) for b in self.banned)
        self.masked = 0
        self.split_matches = 0  # matches that straddled two deltas (what the holding back is for)

    def _mask(self, text: str) -> str:
        low = text.lower()
        for b in self.banned:
            start = low.find(b)
            while start >= 0:
                text = text[:start] + "*" * len(b) + text[start + len(b):]
                low = text.lower()
                self.masked += 1
                start = low.find(b, start + len(b))
        return text

    def on_delta(self, ctx, index, text, final):
        held = ctx.state.setdefault(self.name, {})
        raw = held.get(index, "") + text
        self.split_matches += sum(raw.lower().count(b) - text.lower().count(b) for b in self.banned)
        buf = self._mask(raw)
        if final:
            held[index] = ""
            return buf
        keep = self.longest - 1  # a banned phrase may start in the last longest-1 characters
        out, held[index] = (buf[:-keep], buf[-keep:]) if len(buf) > keep else ("", buf)
        return out


class Exploding(Plugin):
    """Fails on purpose: in on_request when a message or prompt says "explode", in on_delta when "explode-later"."""

    name = "exploding"

    def on_request(self, ctx, body):
        text = str(body.get("messages") or body.get("prompt"))
        if "explode-later" in text:
            ctx.state[self.name] = True
        elif "explode" in text:
            raise RuntimeError("boom on request")
        return None

    def on_delta(self, ctx, index, text, final):
        if ctx.state.get(self.name):
            raise RuntimeError("boom on delta")
        return text
