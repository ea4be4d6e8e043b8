"""Golden renderings (exact strings) of the built-in templates and of an HF-style template,
and the template-selection rule."""

from __future__ import annotations

import pytest

from text_helpers import BOS
from deepinfer_jax.text import BUILTIN_TEMPLATES, ChatTemplateError, load_tokenizer
from deepinfer_jax.text.builtin_templates import TOOLS_PREAMBLE, TOOLS_PREAMBLE_V31

EOS = "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TOOL_JSON = ('{"type": "function", "function": {"name": "get_weather", "description": '
             '"Current weather for a city", "parameters": {"type": "object", "properties": '
             '{"city": {"type": "string"}}, "required": ["city"]}}}')
SYSTEM_AND_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>greet</think>Hello!"},
    {"role": "user", "content": "2+2?"},
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    {"role": "tool", "tool_call_id": "c2", "content": "20C"},
]
CALLS = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
         'get_weather\n```json\n{"city": "Lyon"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
OUTPUTS = ("<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18C<｜tool▁output▁end｜>\n"
           "<｜tool▁output▁begin｜>20C<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")


@pytest.fixture
def builtin(make_dir):
    def _load(name):
        return load_tokenizer(make_dir(f"plain-{name}"), chat_template=name)
    return _load


def test_tools_preamble_is_documented_text():
    assert TOOLS_PREAMBLE == (
        "## Tools\n\nYou can call the functions listed below. To call functions, reply in exactly "
        "this format, one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> per call, calls separated by "
        "a newline:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>FUNCTION_NAME\n"
        '```json\n{"argument_name": "value"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n'
        "The arguments must be valid JSON that follows the function's parameters schema.\n\n"
        "### Functions")


def test_v3_golden(builtin):
    tok = builtin("deepseek_v3")
    assert tok.apply_chat_template(SYSTEM_AND_TURNS) == (
        f"{BOS}You are terse.{U}Hi{A}<think>greet</think>Hello!{EOS}{U}2+2?{A}")
    assert tok.apply_chat_template(SYSTEM_AND_TURNS, add_generation_prompt=False) == (
        f"{BOS}You are terse.{U}Hi{A}<think>greet</think>Hello!{EOS}{U}2+2?")
    two_systems = [{"role": "system", "content": "A"}, {"role": "user", "content": "q"},
                   {"role": "system", "content": "B"}]
    assert tok.apply_chat_template(two_systems) == f"{BOS}A\n\nB{U}q{A}"
    # tools go into the system text; tool results close the turn without a generation prompt
    assert tok.apply_chat_template([SYSTEM_AND_TURNS[0]] + TOOL_CONVERSATION, tools=TOOLS) == (
        f"{BOS}You are terse.\n\n{TOOLS_PREAMBLE}\n```json\n{TOOL_JSON}\n```"
        f"{U}Weather in Paris and Lyon?{A}Checking.{CALLS}{EOS}{OUTPUTS}")
    # after tool results the answer follows <｜tool▁outputs▁end｜> directly
    follow = TOOL_CONVERSATION + [{"role": "assistant", "content": "Paris 18C, Lyon 20C."},
                                  {"role": "user", "content": "Thanks"}]
    assert tok.apply_chat_template(follow, tools=TOOLS) == (
        f"{BOS}{TOOLS_PREAMBLE}\n```json\n{TOOL_JSON}\n```"
        f"{U}Weather in Paris and Lyon?{A}Checking.{CALLS}{EOS}{OUTPUTS}"
        f"Paris 18C, Lyon 20C.{EOS}{U}Thanks{A}")


def test_r1_golden(builtin):
    tok = builtin("deepseek_r1")
    assert tok.apply_chat_template(SYSTEM_AND_TURNS) == (
        f"{BOS}You are terse.{U}Hi{A}Hello!{EOS}{U}2+2?{A}<think>\n")
    assert tok.apply_chat_template(SYSTEM_AND_TURNS, add_generation_prompt=False) == (
        f"{BOS}You are terse.{U}Hi{A}Hello!{EOS}{U}2+2?")
    single = [{"role": "user", "content": "W?"},
              {"role": "assistant", "content": "<think>need tool</think>", "tool_calls": [
                  {"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
              {"role": "tool", "content": "OUT"},
              {"role": "assistant", "content": "<think>ok</think>Done."},
              {"role": "user", "content": "More?"}]
    assert tok.apply_chat_template(single, tools=TOOLS[:1]) == (
        f"{BOS}{TOOLS_PREAMBLE}\n```json\n{TOOL_JSON}\n```{U}W?{A}"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```"
        f"<｜tool▁call▁end｜><｜tool▁calls▁end｜>{EOS}"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>OUT<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
        f"Done.{EOS}{U}More?{A}<think>\n")


def test_v31_golden(builtin):
    """The V3.1 format (DeepSeek-V3.2's): "</think>" opens a non-thinking answer, `thinking=True` opens reasoning,
    past reasoning is dropped, tool calls carry no type or fences, tool results stand unwrapped."""
    tok = builtin("deepseek_v31")
    assert tok.apply_chat_template(SYSTEM_AND_TURNS) == (
        f"{BOS}You are terse.{U}Hi{A}</think>Hello!{EOS}{U}2+2?{A}</think>")
    assert tok.apply_chat_template(SYSTEM_AND_TURNS, thinking=True).endswith(f"{U}2+2?{A}<think>")
    assert tok.apply_chat_template(SYSTEM_AND_TURNS, add_generation_prompt=False) == (
        f"{BOS}You are terse.{U}Hi{A}</think>Hello!{EOS}{U}2+2?")
    calls = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
             '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Lyon"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    outputs = "<｜tool▁output▁begin｜>18C<｜tool▁output▁end｜><｜tool▁output▁begin｜>20C<｜tool▁output▁end｜>"
    # tools go into the system text; tool results end the prompt without a generation prompt
    assert tok.apply_chat_template([SYSTEM_AND_TURNS[0]] + TOOL_CONVERSATION, tools=TOOLS) == (
        f"{BOS}You are terse.\n\n{TOOLS_PREAMBLE_V31}\n```json\n{TOOL_JSON}\n```"
        f"{U}Weather in Paris and Lyon?{A}</think>Checking.{calls}{EOS}{outputs}")
    follow = TOOL_CONVERSATION + [{"role": "assistant", "content": "Paris 18C, Lyon 20C."},
                                  {"role": "user", "content": "Thanks"}]
    assert tok.apply_chat_template(follow).endswith(f"{EOS}{outputs}Paris 18C, Lyon 20C.{EOS}{U}Thanks{A}</think>")


def test_v2_lite_chat_golden(builtin):
    tok = builtin("deepseek_v2")
    assert tok.apply_chat_template(SYSTEM_AND_TURNS) == (
        f"{BOS}You are terse.\n\nUser: Hi\n\nAssistant: <think>greet</think>Hello!{EOS}"
        "User: 2+2?\n\nAssistant:")
    assert tok.apply_chat_template(SYSTEM_AND_TURNS[1:2], add_generation_prompt=False) == (
        f"{BOS}User: Hi\n\n")
    with pytest.raises(ChatTemplateError, match="no tool-call format"):
        tok.apply_chat_template(SYSTEM_AND_TURNS, tools=TOOLS)
    with pytest.raises(ChatTemplateError, match="unsupported message role"):
        tok.apply_chat_template(TOOL_CONVERSATION)


def test_tokenize_true_has_exactly_one_bos(builtin):
    tok = builtin("deepseek_r1")
    ids = tok.apply_chat_template(SYSTEM_AND_TURNS, tokenize=True)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert ids == tok.encode(tok.apply_chat_template(SYSTEM_AND_TURNS))
    assert tok.decode(ids) == tok.apply_chat_template(SYSTEM_AND_TURNS)
    assert ids[-3:-1] == [tok.convert_tokens_to_ids(A), tok.convert_tokens_to_ids("<think>")]
    assert tok.decode(ids[-1:]) == "\n"


HF_STYLE = (
    "{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}[SYS]{{ m.content }}\n"
    "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>{% generation %}{{ m.content }}{% endgeneration %}"
    "{% for tc in m.tool_calls or [] %}<call>{{ tc.function | tojson(indent=1) }}</call>{% endfor %}"
    "{{ eos_token }}{% elif m.role == 'tool' %}<out>{{ m.content }}</out>"
    "{% else %}{{ raise_exception('bad role ' + m.role) }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% if thinking %}<think>\n{% else %}</think>{% endif %}"
    "{% endif %}{% if show_date %}{{ strftime_now('%Y') | length }}{% endif %}")


def test_hf_style_template_with_tools_from_tokenizer_config(make_dir):
    tok = load_tokenizer(make_dir("hf-style", tokenizer_config={"chat_template": HF_STYLE}))
    assert tok.chat_template_source == "tokenizer_config.json"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "天气?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "w", "arguments": {"city": "巴黎"}}}]},
            {"role": "tool", "content": [{"type": "text", "text": "18"}, {"type": "text", "text": "C"}]}]
    tools = [{"type": "function", "function": {"name": "w", "description": "天气"}}]
    # trim_blocks eats the newline after each "{% endif %}" (checked against transformers)
    assert tok.apply_chat_template(msgs, tools=tools, thinking=True) == (
        f'{BOS}<tools>{{"type": "function", "function": {{"name": "w", "description": "天气"}}}}\n'
        "</tools>\n[SYS]Be brief.\n<｜User｜>天气?"
        '<｜Assistant｜><call>{\n "name": "w",\n "arguments": {\n  "city": "巴黎"\n }\n}</call>'
        f"{EOS}<out>18C</out><｜Assistant｜><think>\n")
    assert tok.apply_chat_template(msgs[:2], add_generation_prompt=True, show_date=True) == (
        f"{BOS}[SYS]Be brief.\n<｜User｜>天气?<｜Assistant｜></think>4")
    with pytest.raises(ChatTemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="not supported"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


def test_template_list_form_default_and_tool_use(make_dir):
    tc = {"chat_template": [{"name": "default", "template": "D{{ messages[0].content }}"},
                            {"name": "tool_use", "template": "T{{ tools | length }}"}]}
    tok = load_tokenizer(make_dir("listform", tokenizer_config=tc))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "Dx"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=TOOLS) == "T1"


def test_selection_rule(make_dir, tmp_path):
    sel = lambda d, **kw: load_tokenizer(d, **kw).chat_template_source  # noqa: E731
    assert sel(make_dir("DeepSeek-R1-Distill-tiny")) == "builtin:deepseek_r1"
    assert sel(make_dir("x1", config={"model_type": "deepseek_v3",
                                      "_name_or_path": "deepseek-ai/DeepSeek-R1-0528"})) == "builtin:deepseek_r1"
    assert sel(make_dir("DeepSeek-V2-Lite-Chat", config={"model_type": "deepseek_v2"})) == "builtin:deepseek_v2"
    assert sel(make_dir("DeepSeek-V3-tiny", config={"model_type": "deepseek_v3"})) == "builtin:deepseek_v3"
    assert sel(make_dir("prover1", config={"model_type": "deepseek_v3"})) == "builtin:deepseek_v3"
    assert sel(make_dir("DeepSeek-V3.2-tiny", config={"model_type": "deepseek_v32"})) == "builtin:deepseek_v31"
    assert sel(make_dir("DeepSeek-V4-tiny", config={"model_type": "deepseek_v4"})) == "builtin:deepseek_v31"
    # the directory's own template beats built-ins; chat_template.jinja beats tokenizer_config
    d = make_dir("own-r1", tokenizer_config={"chat_template": "TC"})
    assert sel(d) == "tokenizer_config.json"
    d = make_dir("jinja-r1", tokenizer_config={"chat_template": "TC"},
                 extra_files={"chat_template.jinja": "FILE{{ messages | length }}"})
    tok = load_tokenizer(d)
    assert tok.chat_template_source == "chat_template.jinja"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "FILE1"
    # the user's template wins: a file, a built-in name, or template text
    f = tmp_path / "my.jinja"
    f.write_text("MINE{{ bos_token }}", encoding="utf-8")
    assert load_tokenizer(d, chat_template=str(f)).apply_chat_template([]) == "MINE" + BOS
    assert sel(d, chat_template="deepseek_v2") == "builtin:deepseek_v2"
    assert load_tokenizer(d, chat_template="{{ 'S' }}").apply_chat_template([]) == "S"
    with pytest.raises(ChatTemplateError, match="neither an existing file"):
        load_tokenizer(d, chat_template="/no/such/template.jinja")
    # other model types still get the V3 template when the vocabulary has <｜User｜>
    assert sel(make_dir("plain", config={"model_type": "llama"})) == "builtin:deepseek_v3"
    assert set(BUILTIN_TEMPLATES) == {"deepseek_v2", "deepseek_v3", "deepseek_r1", "deepseek_v31"}


def test_model_template_that_does_not_compile_fails_at_load(make_dir):
    """The directory's own template is compiled when the tokenizer loads (serve's start, LLM's), as --chat-template
    is: one line naming the file (and the list entry), not an error at the first chat request."""
    import os

    d = make_dir("bad-tc", tokenizer_config={"chat_template": "{% if %}"})
    with pytest.raises(ChatTemplateError) as e:
        load_tokenizer(d)
    assert str(e.value) == (f"{os.path.join(d, 'tokenizer_config.json')} chat_template: chat template does not "
                            "compile: Expected an expression, got 'end of statement block'; pass one that compiles "
                            "with --chat-template")
    d = make_dir("bad-list", tokenizer_config={"chat_template": [{"name": "default", "template": "D"},
                                                                 {"name": "tool_use", "template": "{% foo %}"}]})
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json chat_template 'tool_use': chat template does "
                                                r"not compile: Encountered unknown tag 'foo'; pass one"):
        load_tokenizer(d)
    d = make_dir("bad-jinja", extra_files={"chat_template.jinja": "{{ x"})
    with pytest.raises(ChatTemplateError, match=r"/chat_template.jinja: chat template does not compile"):
        load_tokenizer(d)
    assert load_tokenizer(d, chat_template="deepseek_v3").chat_template_source == "builtin:deepseek_v3"


def test_no_template_raises(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel()
    d = tmp_path / "bare"
    d.mkdir()
    t.save(str(d / "tokenizer.json"))
    tok = load_tokenizer(str(d))  # no config.json, no hint, no <｜User｜> in the vocabulary
    assert tok.chat_template is None and tok.chat_template_source is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])
