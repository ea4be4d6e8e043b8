"""Training and evaluation conversations of the default model, generated from templates and word lists.

Four skills, each a generator `rng -> (messages, tools, check)`:
- chat: greetings, what the model is, small talk, in a closed set of reply sentences (REPLIES), so a
  reply is "grammatical template-like English" when every sentence of it is one of them (`chat_ok`);
- arithmetic: two-digit sums and one-digit products, the working inside <think>...</think> first;
- tools: get_weather(city) / get_time(timezone) calls in the DeepSeek-V3 format when the tools are
  offered and asked for, and an answer from the tool result message;
- json: an object with the asked keys.

Held out (never in training, `split="eval"`): every city, name, timezone, number pair and JSON key pair
whose crc32 is 0 mod 8, and the last user phrasing of each list. Cities are built from syllables (about
1,700 names) plus a list of real ones, so evaluation sees city names never trained on.
"""

from __future__ import annotations

import json
import re
import zlib

import numpy as np

PRE = ["Ash", "Bel", "Bram", "Cal", "Dor", "El", "Fair", "Glen", "Har", "Kings", "Lin", "Mar", "Nor", "Oak",
       "Pem", "Ros", "Sand", "Stan", "Thorn", "Wes", "Win", "Al", "Bar", "Clay", "Dun", "Ever", "Gran",
       "Hol", "Lan", "Mon", "New", "Port", "Red", "Silver", "Tor", "Val", "Wood", "Yar", "Zel", "Brook"]
SUF = ["ford", "ton", "bury", "ville", "field", "mouth", "wick", "dale", "port", "haven", "stead", "ham",
       "by", "ley", "worth", "gate", "bridge", "more", "wood", "burg", "stone", "cliff", "view", "ridge",
       "side", "bay", "hill", "land", "vale", "moor", "crest", "minster", "holm", "thorpe", "ness", "ia",
       "ora", "ene", "ino", "ara", "eth", "ania"]
REAL = ["Paris", "London", "Berlin", "Madrid", "Rome", "Tokyo", "Lima", "Cairo", "Oslo", "Dublin", "Vienna",
        "Prague", "Lisbon", "Athens", "Warsaw", "Seoul", "Delhi", "Mumbai", "Sydney", "Toronto", "Chicago",
        "Boston", "Denver", "Austin", "Miami", "Nairobi", "Lagos", "Accra", "Quito", "Bogota", "Santiago",
        "Havana", "Manila", "Hanoi", "Bangkok", "Jakarta", "Beijing", "Shanghai", "Istanbul", "Moscow",
        "Helsinki", "Stockholm", "Copenhagen", "Amsterdam", "Brussels", "Zurich", "Geneva", "Munich",
        "Milan", "Naples", "Venice", "Porto", "Seville", "Valencia", "Krakow", "Budapest", "Bucharest",
        "Sofia", "Riga", "Tallinn", "Vilnius", "Reykjavik", "Edinburgh", "Glasgow", "Cardiff", "Belfast",
        "Montreal", "Vancouver", "Seattle", "Portland", "Phoenix", "Dallas", "Houston", "Atlanta", "Detroit",
        "Auckland", "Perth", "Adelaide", "Melbourne", "Brisbane", "Kyoto", "Osaka", "Taipei", "Dhaka"]
CITIES = sorted(set(REAL + [p + s for p in PRE for s in SUF]))
ZONES = ["Europe/Paris", "Europe/London", "Europe/Berlin", "Europe/Madrid", "Europe/Rome", "Europe/Oslo",
         "Europe/Vienna", "Europe/Prague", "Europe/Lisbon", "Europe/Athens", "Europe/Warsaw", "Europe/Dublin",
         "Asia/Tokyo", "Asia/Seoul", "Asia/Kolkata", "Asia/Shanghai", "Asia/Bangkok", "Asia/Dubai",
         "Asia/Jakarta", "Asia/Manila", "America/New_York", "America/Chicago", "America/Denver",
         "America/Los_Angeles", "America/Toronto", "America/Lima", "America/Bogota", "America/Santiago",
         "Africa/Cairo", "Africa/Lagos", "Africa/Nairobi", "Australia/Sydney", "Australia/Perth", "UTC"]
ZONES += [f"UTC{s}{h}" for s in "+-" for h in range(1, 13)]
NAMES = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack", "Karen",
         "Leo", "Maria", "Nina", "Oscar", "Paul", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Victor", "Wendy",
         "Xavier", "Yara", "Zoe", "Amir", "Bella", "Chen", "Dara", "Elif", "Femi", "Hana", "Ivan", "Jun",
         "Kofi", "Lena", "Mei", "Noor", "Omar", "Priya", "Ravi", "Sofia", "Tomas", "Yusuf", "Ana", "Ben"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy"]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
JSON_KEYS = {"name": lambda r: r.choice(NAMES), "age": lambda r: int(r.integers(1, 99)),
             "city": lambda r: r.choice(CITIES), "color": lambda r: r.choice(COLORS),
             "count": lambda r: int(r.integers(0, 50)), "price": lambda r: int(r.integers(1, 500)),
             "active": lambda r: bool(r.integers(0, 2)), "year": lambda r: int(r.integers(1950, 2030)),
             "score": lambda r: int(r.integers(0, 100)), "title": lambda r: r.choice(["Dr", "Mr", "Ms"]),
             "weather": lambda r: r.choice(CONDITIONS), "size": lambda r: r.choice(["small", "large"]),
             "email": lambda r: r.choice(NAMES).lower() + "@example.com", "id": lambda r: int(r.integers(1, 999)),
             "language": lambda r: r.choice(["English", "French", "Spanish"]),
             "day": lambda r: r.choice(["Monday", "Friday", "Sunday"])}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the current time in a timezone",
     "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}},
]
SYSTEMS = ["You are a helpful assistant.", "You are a friendly assistant. Keep answers short."]

# intent -> (user phrasings, the last one held out; replies)
CHAT = {
    "greet": (["Hello!", "Hi.", "Hi there!", "Hey!", "Good morning!", "Good evening.", "Hello there."],
              ["Hello! How can I help you today?", "Hi! What can I do for you?"]),
    "who": (["Who are you?", "What are you?", "Tell me about yourself.", "What is your name?",
             "Introduce yourself."],
            ["I am a small language model served by deepinfer. I can chat, do simple sums, call tools and "
             "write JSON."]),
    "how": (["How are you?", "How are you today?", "How is it going?", "Are you well?", "How do you feel?"],
            ["I am fine, thank you. How are you?", "I am doing well, thank you for asking."]),
    "can": (["What can you do?", "How can you help me?", "What are you good at?", "What do you do?"],
            ["I can chat with you, add and multiply small numbers, check the weather and the time with "
             "tools, and write JSON."]),
    "thanks": (["Thank you!", "Thanks.", "Thanks a lot!", "Thank you very much."],
               ["You are welcome!", "You are welcome. Is there anything else I can do?"]),
    "bye": (["Goodbye!", "Bye.", "See you later!", "Good night."], ["Goodbye! Have a nice day."]),
    "fine": (["I am fine, thanks.", "I am good.", "Not bad, thank you.", "I am doing well."],
             ["That is good to hear. What would you like to do?"]),
    "color": (["What is your favourite colour?", "Which colour do you like?", "Do you have a favourite colour?"],
              ["I like blue, the colour of a clear sky."]),
}
NAME_PROMPTS = ["My name is {n}.", "I am {n}.", "Call me {n}.", "Hello, I am {n}."]
NAME_REPLY = "Nice to meet you, {n}! How can I help you?"
REPLIES = {s for _, rs in CHAT.values() for r in rs for s in re.split(r"(?<=[.!?]) ", r)}
SUM_Q = ["What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "Calculate {a} + {b}.",
         "How much is {a} plus {b}?", "Please compute {a} + {b}."]
MUL_Q = ["What is {a} times {b}?", "What is {a} * {b}?", "Multiply {a} by {b}.", "Calculate {a} x {b}.",
         "How much is {a} times {b}?", "What do you get when you multiply {a} and {b}?"]
WEATHER_Q = ["What is the weather in {c}?", "How is the weather in {c} today?", "Tell me the weather in {c}.",
             "Is it sunny in {c}?", "Weather in {c}, please.", "What's the weather like in {c} right now?"]
TIME_Q = ["What time is it in {z}?", "Tell me the time in {z}.", "What is the current time in {z}?",
          "Time in {z}, please.", "Could you tell me the current time in {z}?"]
JSON_Q = ["Give me a JSON object with the keys {keys}.", "Write JSON with the keys {keys}.",
          "Reply in JSON with {keys}.", "Make a JSON object that has {keys}.", "Return a JSON object with {keys}."]


def held_out(item) -> bool:
    return zlib.crc32(str(item).encode()) % 8 == 0


def _pick(rng, items, split: str, phrasing: bool = False):
    """A training item (not held out) or an evaluation item. Phrasing lists: the last is held out."""
    if phrasing:
        return items[-1] if split == "eval" else items[int(rng.integers(0, len(items) - 1))]
    while True:
        x = items[int(rng.integers(0, len(items)))]
        if held_out(x) == (split == "eval"):
            return x


def chat_ok(text: str, name: str | None = None) -> bool:
    """Every sentence of `text` is a known reply sentence (a greeting's name slot filled with `name`)."""
    sents = [s for s in re.split(r"(?<=[.!?]) ", text.strip()) if s]
    ok = REPLIES | ({f"Nice to meet you, {name}!", "How can I help you?"} if name else set())
    return bool(sents) and all(s in ok for s in sents)


def conv_chat(rng, split):
    if rng.random() < 0.2:
        n = _pick(rng, NAMES, split)
        user = _pick(rng, NAME_PROMPTS, split, True).format(n=n)
        return [{"role": "user", "content": user}], NAME_REPLY.format(n=n), ("chat", n)
    intent = list(CHAT)[int(rng.integers(0, len(CHAT)))]
    users, replies = CHAT[intent]
    user = _pick(rng, users, split, True)
    if rng.random() < 0.3:
        user = user.lower() if rng.random() < 0.5 else user.rstrip(".!?")
    return [{"role": "user", "content": user}], replies[int(rng.integers(0, len(replies)))], ("chat", None)


def conv_arith(rng, split):
    if rng.random() < 0.55:
        while True:
            a, b = (int(x) for x in rng.integers(10, 100, 2))
            if held_out((a, b)) == (split == "eval"):
                break
        lo = a % 10 + b % 10
        carry = lo // 10
        think = (f"{a % 10} + {b % 10} = {lo}, so the last digit is {lo % 10}"
                 + (f" and I carry 1. {a // 10} + {b // 10} + 1 = {a // 10 + b // 10 + 1}." if carry else
                    f". {a // 10} + {b // 10} = {a // 10 + b // 10}.") + f" So {a} + {b} = {a + b}.")
        q, ans, answer = _pick(rng, SUM_Q, split, True).format(a=a, b=b), f"{a} + {b} = {a + b}.", a + b
    else:
        a, b = (int(x) for x in rng.integers(1, 10, 2))
        think = f"{a} times {b} is {a * b}."
        q, ans, answer = _pick(rng, MUL_Q, split, True).format(a=a, b=b), f"{a} times {b} is {a * b}.", a * b
    return [{"role": "user", "content": q}], f"<think>\n{think}\n</think>\n\n{ans}", ("arith", answer)


def conv_tool(rng, split):
    """(messages, reply, check); messages may already hold the call and its result (then reply answers)."""
    if rng.random() < 0.6:
        c = _pick(rng, CITIES, split)
        q, name, args = _pick(rng, WEATHER_Q, split, True).format(c=c), "get_weather", {"city": c}
        t, cond = int(rng.integers(-10, 36)), CONDITIONS[int(rng.integers(0, len(CONDITIONS)))]
        result = {"city": c, "temperature": t, "condition": cond}
        answer = f"It is {t} degrees and {cond} in {c}."
    else:
        z = _pick(rng, ZONES, split)
        q, name, args = _pick(rng, TIME_Q, split, True).format(z=z), "get_time", {"timezone": z}
        hh, mm = int(rng.integers(0, 24)), int(rng.integers(0, 60))
        result = {"timezone": z, "time": f"{hh:02d}:{mm:02d}"}
        answer = f"It is {hh:02d}:{mm:02d} in {z}."
    msgs = [{"role": "user", "content": q}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}
    if rng.random() < 0.5:
        return msgs, call, ("tool", (name, args))
    msgs += [call, {"role": "tool", "content": json.dumps(result)}]
    return msgs, answer, ("tool_answer", answer)


def conv_json(rng, split):
    keys = list(JSON_KEYS)
    while True:
        k = [keys[i] for i in rng.choice(len(keys), int(rng.integers(2, 4)), replace=False)]
        if held_out(tuple(sorted(k))) == (split == "eval"):
            break
    spoken = ", ".join(k[:-1]) + " and " + k[-1]
    obj = {key: JSON_KEYS[key](rng) for key in k}
    return [{"role": "user", "content": _pick(rng, JSON_Q, split, True).format(keys=spoken)}], json.dumps(obj), ("json", k)


SKILLS = {"chat": (conv_chat, 0.25), "arith": (conv_arith, 0.3), "tool": (conv_tool, 0.3), "json": (conv_json, 0.15)}


def example(rng, split: str = "train", skill: str | None = None):
    """(messages ending with the assistant turn to learn, tools or None, check). Tools are always offered for
    tool requests and in a third of the others; a fifth start with a small-talk exchange, and a system
    message comes first in a quarter."""
    if skill is None:
        names = list(SKILLS)
        skill = names[int(rng.choice(len(names), p=[SKILLS[n][1] for n in names]))]
    msgs, reply, check = SKILLS[skill][0](rng, split)
    if rng.random() < 0.2:  # an earlier small-talk exchange: multi-turn conversations, as `deepinfer chat` has
        before, before_reply, _ = conv_chat(rng, split)
        msgs = before + [{"role": "assistant", "content": before_reply}] + msgs
    tools = TOOLS if skill == "tool" or rng.random() < 0.33 else None
    if rng.random() < 0.25:
        msgs = [{"role": "system", "content": SYSTEMS[int(rng.integers(0, len(SYSTEMS)))]}] + msgs
    last = reply if isinstance(reply, dict) else {"role": "assistant", "content": reply}
    return msgs + [last], tools, check


SPECIAL_TOKENS = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}


def render_with_mask(messages, tools, template: str) -> tuple[str, list[tuple[int, int]]]:
    """(full text, [start, end) character spans of the assistant turns) as the chat template renders them."""
    from functools import partial

    from deepinfer_jax.text.chat_template import render_chat_template

    render_chat_template = partial(render_chat_template, special_tokens=SPECIAL_TOKENS)
    full = render_chat_template(template, messages, tools=tools, add_generation_prompt=False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        pre = render_chat_template(template, messages[:k], tools=tools, add_generation_prompt=True)
        upto = render_chat_template(template, messages[:k + 1], tools=tools, add_generation_prompt=False)
        assert full.startswith(pre) and full.startswith(upto), "chat template is not prefix-stable"
        spans.append((len(pre), len(upto)))
    return full, spans
