r"""Built-in chat templates for DeepSeek models whose directory ships none.

These are our own Jinja renderings of the formats in deepseek-models.md §5, written for HF's
rendering conventions (trim_blocks, lstrip_blocks; every tag here is whitespace-trimmed, so only
the `{{ }}` expressions produce output).

`deepseek_v2` (DeepSeek-V2-Lite-Chat):
    BOS, then per message in order: system -> "{c}\n\n"; user -> "User: {c}\n\n";
    assistant -> "Assistant: {c}<eos>"; generation prompt "Assistant:" (no space).
    `tools=` or a `tool` message raises (the model has no tool-call format).

`deepseek_v3` and `deepseek_r1` (V3 / R1 special-token format):
    BOS, all system messages joined with "\n\n" (no marker), then the tool block (below) if
    `tools` is given, then per message:
      user       -> [<｜tool▁outputs▁end｜> if a tool run is open] "<｜User｜>{c}"
      assistant  -> "<｜Assistant｜>" (or "<｜tool▁outputs▁end｜>" right after tool results),
                    "{c}", then if tool_calls:
                    "<｜tool▁calls▁begin｜>" + calls joined by "\n" + "<｜tool▁calls▁end｜>",
                    each call "<｜tool▁call▁begin｜>{type}<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>",
                    then "<｜end▁of▁sentence｜>"   (args: a string as given, a mapping via tojson)
      tool       -> first of a run "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{c}<｜tool▁output▁end｜>",
                    later ones "\n<｜tool▁output▁begin｜>{c}<｜tool▁output▁end｜>"
    End: an open tool run is closed with "<｜tool▁outputs▁end｜>" and then NO generation prompt
    (the model continues its turn); otherwise add_generation_prompt appends "<｜Assistant｜>",
    and for `deepseek_r1` "<｜Assistant｜><think>\n" (the later R1 revision that forces reasoning).
    R1 also keeps only the text after the last "</think>" of past assistant turns.
    Unlike DeepSeek's originals, every tool-call message is closed and gets its own
    "<｜Assistant｜>" (the originals forget both after the first call).

`deepseek_v31` (the V3.1 format, which DeepSeek-V3.2 keeps): BOS, the system text (and tool block, with
    TOOLS_PREAMBLE_V31), then per message:
      user       -> "<｜User｜>{c}"
      assistant  -> after a user turn "<｜Assistant｜></think>" (past reasoning is not shown: only the text
                    after its last "</think>"), "{c}", then if tool_calls "<｜tool▁calls▁begin｜>" + each
                    "<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>" + "<｜tool▁calls▁end｜>",
                    then "<｜end▁of▁sentence｜>"
      tool       -> "<｜tool▁output▁begin｜>{c}<｜tool▁output▁end｜>"
    End: after tool results NO generation prompt (the model continues its turn); otherwise add_generation_prompt
    appends "<｜Assistant｜></think>", or "<｜Assistant｜><think>" with `thinking=True` (chat_template_kwargs).

Tool block (DeepSeek's templates ignore `tools=`; like vLLM's/SGLang's deepseek tool templates
we describe the tools in the system text). Exactly, with TOOLS_PREAMBLE below:
    system_text + "\n\n" (only if there was a system message) + TOOLS_PREAMBLE
    + for each tool: "\n```json\n" + tojson(tool) + "\n```"
where tojson is json.dumps(tool, ensure_ascii=False) of the whole OpenAI tool object.
"""

from __future__ import annotations

TOOLS_PREAMBLE = (
    "## Tools\n\n"
    "You can call the functions listed below. To call functions, reply in exactly this format, "
    "one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> per call, calls separated by a newline:\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>FUNCTION_NAME\n"
    "```json\n"
    '{"argument_name": "value"}\n'
    "```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n"
    "The arguments must be valid JSON that follows the function's parameters schema.\n\n"
    "### Functions"
)

TOOLS_PREAMBLE_V31 = (
    "## Tools\n\n"
    "You can call the functions listed below. To call functions, reply in exactly this format, "
    "one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> per call:\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>FUNCTION_NAME<｜tool▁sep｜>"
    '{"argument_name": "value"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n'
    "The arguments must be valid JSON that follows the function's parameters schema.\n\n"
    "### Functions"
)

# The system prompt (system messages joined, then the tools' preamble and JSON schemas) after BOS: the V3 and V3.1
# templates share it (their namespaces both carry `system`, `n_sys` and `tools`).
_SYSTEM_HEAD = r"""
{%- for m in messages -%}
  {%- if m['role'] == 'system' -%}
    {%- set ns.system = ns.system ~ ('\n\n' if ns.n_sys > 0 else '') ~ (m['content'] or '') -%}
    {%- set ns.n_sys = ns.n_sys + 1 -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools -%}
  {%- set ns.tools = @@TOOLS_PREAMBLE@@ -%}
  {%- for t in tools -%}
    {%- set ns.tools = ns.tools ~ '\n```json\n' ~ (t | tojson) ~ '\n```' -%}
  {%- endfor -%}
  {%- set ns.system = (ns.system ~ '\n\n' if ns.n_sys > 0 else '') ~ ns.tools -%}
{%- endif -%}
{{- bos_token ~ ns.system -}}"""

_V3_FAMILY = r"""
{%- set ns = namespace(system='', n_sys=0, tool_run=false, tools='') -%}
@@SYSTEM_HEAD@@
{%- for m in messages -%}
  {%- set content = m['content'] or '' -%}
  {%- if m['role'] == 'user' -%}
    {%- if ns.tool_run -%}
      {{- '<｜tool▁outputs▁end｜>' -}}
      {%- set ns.tool_run = false -%}
    {%- endif -%}
    {{- '<｜User｜>' ~ content -}}
  {%- elif m['role'] == 'assistant' -%}
    @@STRIP_THINK@@
    {%- if ns.tool_run -%}
      {{- '<｜tool▁outputs▁end｜>' -}}
      {%- set ns.tool_run = false -%}
    {%- else -%}
      {{- '<｜Assistant｜>' -}}
    {%- endif -%}
    {{- content -}}
    {%- if m['tool_calls'] is defined and m['tool_calls'] -%}
      {{- '<｜tool▁calls▁begin｜>' -}}
      {%- for tc in m['tool_calls'] -%}
        {%- set fn = tc['function'] -%}
        {%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}
        {{- ('\n' if not loop.first else '') ~ '<｜tool▁call▁begin｜>' ~ (tc['type'] or 'function') ~ '<｜tool▁sep｜>' ~ fn['name'] ~ '\n```json\n' ~ args ~ '\n```<｜tool▁call▁end｜>' -}}
      {%- endfor -%}
      {{- '<｜tool▁calls▁end｜>' -}}
    {%- endif -%}
    {{- '<｜end▁of▁sentence｜>' -}}
  {%- elif m['role'] == 'tool' -%}
    {{- ('\n<｜tool▁output▁begin｜>' if ns.tool_run else '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>') ~ content ~ '<｜tool▁output▁end｜>' -}}
    {%- set ns.tool_run = true -%}
  {%- elif m['role'] != 'system' -%}
    {{- raise_exception('unsupported message role: ' ~ m['role']) -}}
  {%- endif -%}
{%- endfor -%}
{%- if ns.tool_run -%}
  {{- '<｜tool▁outputs▁end｜>' -}}
{%- elif add_generation_prompt -%}
  {{- '<｜Assistant｜>@@GEN_SUFFIX@@' -}}
{%- endif -%}
"""

_STRIP_THINK = (
    "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
)



def _jinja_literal(text: str) -> str:
    """`text` as a single-quoted Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


_V3_FAMILY = _V3_FAMILY.replace("@@SYSTEM_HEAD@@", _SYSTEM_HEAD).replace("@@TOOLS_PREAMBLE@@",
                                                                         _jinja_literal(TOOLS_PREAMBLE))
DEEPSEEK_V3_TEMPLATE = _V3_FAMILY.replace("@@STRIP_THINK@@", "").replace("@@GEN_SUFFIX@@", "")
DEEPSEEK_R1_TEMPLATE = _V3_FAMILY.replace("@@STRIP_THINK@@", _STRIP_THINK).replace(
    "@@GEN_SUFFIX@@", r"<think>\n")

DEEPSEEK_V31_TEMPLATE = r"""
{%- set ns = namespace(system='', n_sys=0, after_user=false, after_tool=false, tools='') -%}
@@SYSTEM_HEAD@@
{%- for m in messages -%}
  {%- set content = m['content'] or '' -%}
  {%- if m['role'] == 'user' -%}
    {{- '<｜User｜>' ~ content -}}
    {%- set ns.after_user, ns.after_tool = true, false -%}
  {%- elif m['role'] == 'assistant' -%}
    {%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}
    {%- if ns.after_user -%}
      {{- '<｜Assistant｜></think>' -}}
    {%- endif -%}
    {{- content -}}
    {%- if m['tool_calls'] is defined and m['tool_calls'] -%}
      {{- '<｜tool▁calls▁begin｜>' -}}
      {%- for tc in m['tool_calls'] -%}
        {%- set fn = tc['function'] -%}
        {%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}
        {{- '<｜tool▁call▁begin｜>' ~ fn['name'] ~ '<｜tool▁sep｜>' ~ args ~ '<｜tool▁call▁end｜>' -}}
      {%- endfor -%}
      {{- '<｜tool▁calls▁end｜>' -}}
    {%- endif -%}
    {{- '<｜end▁of▁sentence｜>' -}}
    {%- set ns.after_user, ns.after_tool = false, false -%}
  {%- elif m['role'] == 'tool' -%}
    {{- '<｜tool▁output▁begin｜>' ~ content ~ '<｜tool▁output▁end｜>' -}}
    {%- set ns.after_user, ns.after_tool = false, true -%}
  {%- elif m['role'] != 'system' -%}
    {{- raise_exception('unsupported message role: ' ~ m['role']) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not ns.after_tool -%}
  {{- '<｜Assistant｜>' ~ ('<think>' if thinking is defined and thinking else '</think>') -}}
{%- endif -%}
""".replace("@@SYSTEM_HEAD@@", _SYSTEM_HEAD).replace("@@TOOLS_PREAMBLE@@", _jinja_literal(TOOLS_PREAMBLE_V31))

DEEPSEEK_V2_TEMPLATE = r"""
{%- if tools -%}
  {{- raise_exception('the DeepSeek-V2-Lite-Chat template has no tool-call format; tools are not supported') -}}
{%- endif -%}
{{- bos_token -}}
{%- for m in messages -%}
  {%- set content = m['content'] or '' -%}
  {%- if m['role'] == 'user' -%}
    {{- 'User: ' ~ content ~ '\n\n' -}}
  {%- elif m['role'] == 'assistant' -%}
    {{- 'Assistant: ' ~ content ~ eos_token -}}
  {%- elif m['role'] == 'system' -%}
    {{- content ~ '\n\n' -}}
  {%- else -%}
    {{- raise_exception('unsupported message role for DeepSeek-V2-Lite-Chat: ' ~ m['role']) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- 'Assistant:' -}}
{%- endif -%}
"""

BUILTIN_TEMPLATES: dict[str, str] = {
    "deepseek_v2": DEEPSEEK_V2_TEMPLATE,
    "deepseek_v3": DEEPSEEK_V3_TEMPLATE,
    "deepseek_r1": DEEPSEEK_R1_TEMPLATE,
    "deepseek_v31": DEEPSEEK_V31_TEMPLATE,
}
