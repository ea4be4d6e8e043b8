"""Training and evaluation conversations of the default model, generated from templates and word lists.

Four skills, each a generator `rng, split -> (messages, reply, check)`:
- chat: greetings, what the model is, small talk, in a closed set of reply sentences (REPLIES), so a
  reply is "grammatical template-like English" when every sentence of it is one of them (`chat_ok`);
- arithmetic: two-digit sums worked in columns (ones, carry, tens) and one-digit products, the working
  inside <think>...</think> first;
- tools: get_weather(city) / get_time(timezone) calls in the DeepSeek-V3 format when the tools are
  offered and asked for, and an answer from the tool result message;
- json: an object with the asked keys.

Conversations have 0-3 earlier exchanges before the turn to learn (`example`), each a complete exchange
of any skill (a sum with its working, a JSON object, a tool call with its result and answer, or the
"no tool offered" reply when none is), so that the reply follows the last user message and not the form
of the previous reply; after earlier exchanges, small talk is half of the time thanks or goodbye, and
the other skills' questions are sometimes follow-ups ("And ...", "Now ..."). An earlier arithmetic reply
is mostly without its <think> working, as `deepinfer chat` and API clients send a reply back (content
only, the reasoning separated by the server's parser); such a reply is marked NO_LOSS (it must not teach
answering without working), and every other assistant turn is a reference reply the trainer learns.

The values a reply must copy (cities, timezones, people's names) are mostly made up by a syllable
generator (millions of pronounceable names), so the model learns to copy them from the prompt or the tool
result rather than recall a list. User phrasings are composed: a core sentence per skill, an optional
opening and closing, and a casing variant.

Held out (never in training, `split="eval"`): every name, city, timezone, number pair, JSON key set and
user phrasing (a core sentence with its opening, closing and casing) whose crc32 is 0 mod 8. One-digit products are
facts (all 81 are trained); their held-out part is the phrasing.
"""

from __future__ import annotations

import functools
import json
import re
import zlib

import numpy as np

ONSETS = ["b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "j", "k", "kr", "l", "m", "n", "p", "pr", "r",
          "s", "sh", "st", "t", "th", "tr", "v", "w", "z"]
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ea", "ou"]
CODAS = ["", "", "", "", "", "n", "r", "l", "s", "m"]
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
ZONES = ["Europe/Paris", "Europe/London", "Europe/Berlin", "Europe/Madrid", "Europe/Rome", "Europe/Oslo",
         "Europe/Vienna", "Europe/Prague", "Europe/Lisbon", "Europe/Athens", "Europe/Warsaw", "Europe/Dublin",
         "Asia/Tokyo", "Asia/Seoul", "Asia/Kolkata", "Asia/Shanghai", "Asia/Bangkok", "Asia/Dubai",
         "Asia/Jakarta", "Asia/Manila", "America/New_York", "America/Chicago", "America/Denver",
         "America/Los_Angeles", "America/Toronto", "America/Lima", "America/Bogota", "America/Santiago",
         "Africa/Cairo", "Africa/Lagos", "Africa/Nairobi", "Australia/Sydney", "Australia/Perth", "UTC"]
ZONES += [f"UTC{s}{h}" for s in "+-" for h in range(1, 13)]
REGIONS = ["Europe", "Asia", "America", "Africa", "Australia", "Pacific", "Atlantic", "Indian"]
NAMES = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack", "Karen",
         "Leo", "Maria", "Nina", "Oscar", "Paul", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Victor", "Wendy",
         "Xavier", "Yara", "Zoe", "Amir", "Bella", "Chen", "Dara", "Elif", "Femi", "Hana", "Ivan", "Jun",
         "Kofi", "Lena", "Mei", "Noor", "Omar", "Priya", "Ravi", "Sofia", "Tomas", "Yusuf", "Ana", "Ben"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy"]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]


def held_out(item) -> bool:
    return zlib.crc32(str(item).encode()) % 8 == 0


def _in_split(item, split: str) -> bool:
    return held_out(item) == (split == "eval")


def made_up_name(rng) -> str:
    """A pronounceable name of 2-3 syllables ("Brantovel", "Shiemar")."""
    n = 2 if rng.random() < 0.7 else 3
    parts = [ONSETS[int(rng.integers(len(ONSETS)))] + VOWELS[int(rng.integers(len(VOWELS)))]
             + CODAS[int(rng.integers(len(CODAS)))] for _ in range(n)]
    return "".join(parts).capitalize()


def _draw(rng, split: str, make):
    """`make(rng)` until its value belongs to `split`."""
    while True:
        x = make(rng)
        if _in_split(x, split):
            return x


def _choice(rng, items):
    return items[int(rng.integers(len(items)))]


def city(rng, split: str) -> str:
    """A made-up name (60%), a compound town name (20%) or a real city (20%)."""
    u = rng.random()
    make = (made_up_name if u < 0.6 else (lambda r: _choice(r, PRE) + _choice(r, SUF)) if u < 0.8 else
            (lambda r: _choice(r, REAL)))
    return _draw(rng, split, make)


def timezone(rng, split: str) -> str:
    u = rng.random()
    make = ((lambda r: _choice(r, ZONES)) if u < 0.4 else
            (lambda r: _choice(r, REGIONS) + "/" + (_choice(r, REAL) if r.random() < 0.3 else made_up_name(r))))
    return _draw(rng, split, make)


def person(rng, split: str) -> str:
    return _draw(rng, split, lambda r: _choice(r, NAMES) if r.random() < 0.4 else made_up_name(r))


JSON_KEYS = {"name": lambda r, s: person(r, s), "age": lambda r, s: int(r.integers(1, 99)),
             "city": lambda r, s: city(r, s), "color": lambda r, s: _choice(r, COLORS),
             "count": lambda r, s: int(r.integers(0, 50)), "price": lambda r, s: int(r.integers(1, 500)),
             "active": lambda r, s: bool(r.integers(0, 2)), "year": lambda r, s: int(r.integers(1950, 2030)),
             "score": lambda r, s: int(r.integers(0, 100)), "title": lambda r, s: _choice(r, ["Dr", "Mr", "Ms"]),
             "weather": lambda r, s: _choice(r, CONDITIONS), "size": lambda r, s: _choice(r, ["small", "large"]),
             "email": lambda r, s: person(r, s).lower() + "@example.com", "id": lambda r, s: int(r.integers(1, 999)),
             "language": lambda r, s: _choice(r, ["English", "French", "Spanish"]),
             "day": lambda r, s: _choice(r, ["Monday", "Friday", "Sunday"])}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the current time in a timezone",
     "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}},
]
SYSTEMS = ["You are a helpful assistant.", "You are a friendly assistant. Keep answers short."]

# intent -> (user phrasings, replies)
CHAT = {
    "greet": (["Hello!", "Hi.", "Hi there!", "Hey!", "Good morning!", "Good evening.", "Hello there.",
               "Good afternoon!", "Hey there.", "Hello, how are you?"],
              ["Hello! How can I help you today?", "Hi! What can I do for you?"]),
    "who": (["Who are you?", "What are you?", "Tell me about yourself.", "What is your name?",
             "Introduce yourself.", "Are you a robot?", "What model are you?", "Who made you?"],
            ["I am a small language model served by deepinfer. I can chat, do simple sums, call tools and "
             "write JSON."]),
    "how": (["How are you?", "How are you today?", "How is it going?", "Are you well?", "How do you feel?",
             "How are things?", "How have you been?"],
            ["I am fine, thank you. How are you?", "I am doing well, thank you for asking."]),
    "can": (["What can you do?", "How can you help me?", "What are you good at?", "What do you do?",
             "Can you help me?", "What can I ask you?", "Help."],
            ["I can chat with you, add and multiply small numbers, check the weather and the time with "
             "tools, and write JSON."]),
    "thanks": (["Thank you!", "Thanks.", "Thanks a lot!", "Thank you very much.", "Thanks for your help.",
                "Great, thanks!", "Perfect, thank you.", "Ok, thanks."],
               ["You are welcome!", "You are welcome. Is there anything else I can do?"]),
    "bye": (["Goodbye!", "Bye.", "See you later!", "Good night.", "Bye bye!", "See you soon.", "Thanks, bye.",
             "Ok, goodbye!"],
            ["Goodbye! Have a nice day."]),
    "fine": (["I am fine, thanks.", "I am good.", "Not bad, thank you.", "I am doing well.", "I am great!",
              "All good here."],
             ["That is good to hear. What would you like to do?"]),
    "color": (["What is your favourite colour?", "Which colour do you like?", "Do you have a favourite colour?",
               "What is your favorite color?", "Which color do you like best?"],
              ["I like blue, the colour of a clear sky."]),
}
NAME_PROMPTS = ["My name is {n}.", "I am {n}.", "Call me {n}.", "Hello, I am {n}.", "Hi, my name is {n}.",
                "Hi! I am {n}.", "Hello, my name is {n}."]
NAME_REPLY = "Nice to meet you, {n}! How can I help you?"
NO_TOOL = {"get_weather": "I cannot check the weather here: no weather tool is offered.",
           "get_time": "I cannot check the time here: no time tool is offered."}
REPLIES = ({s for _, rs in CHAT.values() for r in rs for s in re.split(r"(?<=[.!?]) ", r)}
           | set(NO_TOOL.values()))
SUM_Q = ["What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "Calculate {a} + {b}.",
         "How much is {a} plus {b}?", "Please compute {a} + {b}.", "What's {a} + {b}?", "{a} + {b} = ?",
         "What do you get when you add {a} and {b}?", "Can you add {a} and {b}?", "What is the sum of {a} and {b}?",
         "Compute {a} plus {b}.", "{a} plus {b}?"]
MUL_Q = ["What is {a} times {b}?", "What is {a} * {b}?", "Multiply {a} by {b}.", "Calculate {a} x {b}.",
         "How much is {a} times {b}?", "What do you get when you multiply {a} and {b}?", "What's {a} times {b}?",
         "{a} * {b} = ?", "What is the product of {a} and {b}?", "Can you multiply {a} and {b}?", "{a} times {b}?"]
WEATHER_Q = ["What is the weather in {c}?", "How is the weather in {c} today?", "Tell me the weather in {c}.",
             "Is it sunny in {c}?", "Weather in {c}, please.", "What's the weather like in {c} right now?",
             "Can you check the weather in {c}?", "How warm is it in {c}?", "Is it raining in {c}?",
             "I am going to {c}. What is the weather there?", "Weather for {c}?", "Check the weather in {c} for me.",
             "What is the weather like in {c} today?"]
TIME_Q = ["What time is it in {z}?", "Tell me the time in {z}.", "What is the current time in {z}?",
          "Time in {z}, please.", "Could you tell me the current time in {z}?", "What's the time in {z}?",
          "Can you check the time in {z}?", "What time is it now in {z}?", "Current time in {z}?",
          "Check the time in {z} for me."]
JSON_Q = ["Give me a JSON object with the keys {keys}.", "Write JSON with the keys {keys}.",
          "Reply in JSON with {keys}.", "Make a JSON object that has {keys}.", "Return a JSON object with {keys}.",
          "Output a JSON object with the keys {keys}.", "I need JSON with {keys}.",
          "Create a JSON object containing {keys}.", "Please answer with a JSON object with the keys {keys}."]
OPENINGS = ["Please, ", "Hey, ", "Quick question: ", "Hi! ", "Excuse me, ", "Hello. "]
CLOSINGS = [" Thanks!", " Please.", " Thank you.", " Thanks."]
CHAT_OPENINGS = ["Well, ", "Oh, ", "Ok. ", "So, "]
FOLLOW_OPENINGS = ["And ", "Now, ", "Next: ", "One more: ", "Also, "]  # a question after earlier exchanges
EARLIER = (0.4, 0.3, 0.2, 0.1)  # probabilities of 0, 1, 2, 3 earlier exchanges in a training conversation
AFTER = ("thanks", "bye")  # small talk after earlier exchanges is one of these half of the time
KEEP_REASONING = 0.2  # earlier arithmetic replies with their <think> working (else the content only)
NO_LOSS = "no_loss"  # key of an assistant message the trainer does not learn (`render_with_mask` skips it)
CHAT_CLOSINGS = [" :)", "!!"]
VARIANTS = ["", "lower", "bare"]  # as written, all lower case, no final punctuation


def _render_phrasing(core: str, op: str, cl: str, variant: str) -> str:
    text = op + (core[0].lower() + core[1:] if op and core[0] not in "{I" else core) + cl
    if variant == "lower":  # the slots stay as they are: "{a}" -> "{a}"
        return text.lower()
    return text.rstrip(".!?:) ") if variant == "bare" else text


@functools.lru_cache(maxsize=None)
def _phrasings(cores: tuple, openings: tuple, closings: tuple, split: str) -> tuple[list, np.ndarray]:
    """The user sentences of `split` made of a core, an opening, a closing and a casing variant, and their
    probabilities (an opening and a closing each in a quarter, the variant as written in 60%). The split
    is decided on the sentence, so two ways to write one sentence fall on the same side."""
    texts, probs = [], []
    for core in cores:
        for op in ("",) + openings:
            for cl in ("",) + closings:
                for v in VARIANTS:
                    text = _render_phrasing(core, op, cl, v)
                    if _in_split(text, split):
                        texts.append(text)
                        probs.append((0.75 if not op else 0.25 / len(openings)) *
                                     (0.75 if not cl else 0.25 / len(closings)) * (0.6 if not v else 0.2))
    if not texts:
        raise ValueError(f"no {split} phrasing among {cores}: add openings, closings or cores")
    p = np.array(probs)
    return texts, p / p.sum()


def phrasing(rng, split: str, cores: list[str], openings=OPENINGS, closings=CLOSINGS) -> str:
    """A user sentence of `split` (see `_phrasings`). Cores hold {a}/{b}/{c}/{z}/{keys}/{n} slots, filled
    by the caller."""
    texts, p = _phrasings(tuple(cores), tuple(openings), tuple(closings), split)
    return texts[int(rng.choice(len(texts), p=p))]


def chat_ok(text: str, name: str | None = None) -> bool:
    """Every sentence of `text` is a known reply sentence (a greeting's name slot filled with `name`)."""
    sents = [s for s in re.split(r"(?<=[.!?]) ", text.strip()) if s]
    ok = REPLIES | ({f"Nice to meet you, {name}!", "How can I help you?"} if name else set())
    return bool(sents) and all(s in ok for s in sents)


def conv_chat(rng, split, follow=False):
    """(messages, reply, check); `follow`: after earlier exchanges (thanks or goodbye half of the time)."""
    if follow and rng.random() < 0.5:
        intent = AFTER[int(rng.integers(0, len(AFTER)))]
        users, replies = CHAT[intent]
        user = phrasing(rng, split, users, CHAT_OPENINGS, CHAT_CLOSINGS)
        return [{"role": "user", "content": user}], replies[int(rng.integers(0, len(replies)))], ("chat", None)
    if rng.random() < 0.2:
        n = person(rng, split)
        user = phrasing(rng, split, NAME_PROMPTS, CHAT_OPENINGS[:2], CHAT_CLOSINGS).format(n=n)
        return [{"role": "user", "content": user}], NAME_REPLY.format(n=n), ("chat", n)
    intent = list(CHAT)[int(rng.integers(0, len(CHAT)))]
    users, replies = CHAT[intent]
    user = phrasing(rng, split, users, CHAT_OPENINGS, CHAT_CLOSINGS)
    return [{"role": "user", "content": user}], replies[int(rng.integers(0, len(replies)))], ("chat", None)


def sum_working(a: int, b: int) -> str:
    """The column method for two-digit a + b: restate, ones digits and carry, tens digits, result."""
    lo = a % 10 + b % 10
    carry = lo // 10
    hi = a // 10 + b // 10 + carry
    ones = (f"Ones: {a % 10} + {b % 10} = {lo}, write {lo % 10}" + (" and carry 1." if carry else "."))
    tens = f"Tens: {a // 10} + {b // 10}" + (" + 1" if carry else "") + f" = {hi}."
    return f"{a} + {b}. {ones} {tens} So {a} + {b} = {a + b}."


def _openings(rng, follow: bool):
    """The openings of a question: follow-up ones ("And ", "Now, ") in 30% of those after earlier exchanges."""
    return FOLLOW_OPENINGS if follow and rng.random() < 0.3 else OPENINGS


def conv_arith(rng, split, follow=False):
    ops = _openings(rng, follow)
    if rng.random() < 0.6:
        a, b = _draw(rng, split, lambda r: tuple(int(x) for x in r.integers(10, 100, 2)))
        q = phrasing(rng, split, SUM_Q, ops).format(a=a, b=b)
        think, ans, answer = sum_working(a, b), f"{a} + {b} = {a + b}.", a + b
    else:
        a, b = (int(x) for x in rng.integers(1, 10, 2))
        q = phrasing(rng, split, MUL_Q, ops).format(a=a, b=b)
        think, ans, answer = f"{a} x {b}: {a} times {b} is {a * b}.", f"{a} times {b} is {a * b}.", a * b
    return [{"role": "user", "content": q}], f"<think>\n{think}\n</think>\n\n{ans}", ("arith", answer)


def conv_tool(rng, split, follow=False, stage=None):
    """(messages, reply, check); messages may already hold the call and its result (then reply answers).
    `stage`: "none" (asked without the tools offered, as in `deepinfer chat`: the reply says it cannot),
    "call" or "answer"; by default a tenth "none", the rest half "call", half "answer"."""
    if stage is None:
        u = rng.random()
        stage = "none" if u < 0.1 else "call" if u < 0.55 else "answer"
    ops = _openings(rng, follow)
    if rng.random() < 0.6:
        c = city(rng, split)
        q, name, args = phrasing(rng, split, WEATHER_Q, ops).format(c=c), "get_weather", {"city": c}
        t, cond = int(rng.integers(-10, 36)), CONDITIONS[int(rng.integers(0, len(CONDITIONS)))]
        result = {"city": c, "temperature": t, "condition": cond}
        answer = f"It is {t} degrees and {cond} in {c}."
    else:
        z = timezone(rng, split)
        q, name, args = phrasing(rng, split, TIME_Q, ops).format(z=z), "get_time", {"timezone": z}
        hh, mm = int(rng.integers(0, 24)), int(rng.integers(0, 60))
        result = {"timezone": z, "time": f"{hh:02d}:{mm:02d}"}
        answer = f"It is {hh:02d}:{mm:02d} in {z}."
    msgs = [{"role": "user", "content": q}]
    if stage == "none":
        return msgs, NO_TOOL[name], ("chat", None)
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}
    if stage == "call":
        return msgs, call, ("tool", (name, args))
    msgs += [call, {"role": "tool", "content": json.dumps(result)}]
    return msgs, answer, ("tool_answer", answer)


def conv_json(rng, split, follow=False):
    keys = list(JSON_KEYS)
    while True:  # the key set (in any order) belongs to the split
        k = [keys[i] for i in rng.choice(len(keys), int(rng.integers(2, 4)), replace=False)]
        if _in_split(tuple(sorted(k)), split):
            break
    spoken = ", ".join(k[:-1]) + " and " + k[-1]
    obj = {key: JSON_KEYS[key](rng, split) for key in k}
    q = phrasing(rng, split, JSON_Q, _openings(rng, follow)).format(keys=spoken)
    return ([{"role": "user", "content": q}], json.dumps(obj),
            ("json", k))


SKILLS = {"chat": (conv_chat, 0.25), "arith": (conv_arith, 0.3), "tool": (conv_tool, 0.3), "json": (conv_json, 0.15)}


def _pick_skill(rng) -> str:
    names = list(SKILLS)
    return names[int(rng.choice(len(names), p=[SKILLS[n][1] for n in names]))]


def earlier_exchange(rng, split: str, tools_offered: bool, follow: bool, keep_reasoning: float) -> list[dict]:
    """A complete exchange of a skill drawn from the mix, ending with the assistant's final reply: a tool
    question gets its call, result and answer when the tools are offered, else the "no tool" reply; an
    arithmetic reply keeps its <think> working with probability `keep_reasoning`, else it is the content
    only and marked NO_LOSS."""
    skill = _pick_skill(rng)
    if skill == "tool":
        msgs, reply, _ = conv_tool(rng, split, follow, stage="answer" if tools_offered else "none")
    else:
        msgs, reply, _ = SKILLS[skill][0](rng, split, follow)
    if skill == "arith" and rng.random() >= keep_reasoning:
        return msgs + [{"role": "assistant", "content": reply.split("</think>")[-1].strip(), NO_LOSS: True}]
    return msgs + [{"role": "assistant", "content": reply}]


def example(rng, split: str = "train", skill: str | None = None, earlier: int | None = None,
            keep_reasoning: float = KEEP_REASONING):
    """(messages ending with the assistant turn to learn, tools or None, check of that last turn).
    `earlier` complete exchanges of any skills come first (default: 0-3 drawn with EARLIER; see
    `earlier_exchange` for `keep_reasoning`). Tools are
    offered for the tool calls and answers and in a third of the other conversations (never with a "no
    tool" reply); a system message comes first in a quarter."""
    skill = skill or _pick_skill(rng)
    if earlier is None:
        earlier = int(rng.choice(len(EARLIER), p=EARLIER))
    msgs, reply, check = SKILLS[skill][0](rng, split, earlier > 0)
    no_tool_reply = skill == "tool" and check[0] == "chat"
    tools_offered = check[0] in ("tool", "tool_answer") or (not no_tool_reply and rng.random() < 0.33)
    history = [m for k in range(earlier)
               for m in earlier_exchange(rng, split, tools_offered, k > 0, keep_reasoning)]
    msgs = history + msgs
    if rng.random() < 0.25:
        msgs = [{"role": "system", "content": SYSTEMS[int(rng.integers(0, len(SYSTEMS)))]}] + msgs
    last = reply if isinstance(reply, dict) else {"role": "assistant", "content": reply}
    return msgs + [last], TOOLS if tools_offered else None, check


SPECIAL_TOKENS = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}


def render_with_mask(messages, tools, template: str) -> tuple[str, list[tuple[int, int]]]:
    """(full text, [start, end) character spans of the assistant turns to learn, those not marked NO_LOSS)
    as the chat template renders them (the template ignores the NO_LOSS key)."""
    from functools import partial

    from deepinfer_jax.text.chat_template import render_chat_template

    render_chat_template = partial(render_chat_template, special_tokens=SPECIAL_TOKENS)
    full = render_chat_template(template, messages, tools=tools, add_generation_prompt=False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant" or m.get(NO_LOSS):
            continue
        pre = render_chat_template(template, messages[:k], tools=tools, add_generation_prompt=True)
        upto = render_chat_template(template, messages[:k + 1], tools=tools, add_generation_prompt=False)
        assert full.startswith(pre) and full.startswith(upto), "chat template is not prefix-stable"
        spans.append((len(pre), len(upto)))
    return full, spans
