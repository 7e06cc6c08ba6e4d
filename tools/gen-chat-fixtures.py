#!/usr/bin/env python3
"""Chat-template fixtures: renders every shipped chat template with the real
jinja2, set up exactly as HF transformers' apply_chat_template does
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols,
the {% generation %} tag, and transformers' tojson / raise_exception /
strftime_now), over a varied conversation set, and writes
t/data/chat/<template>.jsonl: one line per (conversation, add_generation_prompt)
with the expected text or the expected error; and t/data/chat/snippets.jsonl:
small templates that each check one construct (whitespace control, numbers,
repr, filters, tests, methods, scoping, errors).

Templates: conf/tokenizers/*/ and conf/templates/*/ (tokenizer_config.json
"chat_template", else chat_template.jinja next to it). Special tokens as
transformers passes them (bos/eos/unk/pad from tokenizer_config.json;
{"content": ...} objects give their content; null ones are left out).

Content normalisation (vLLM's rule, documented in src/text/kv_chat.c): if
the template never loops over a message's content, list content becomes its
text parts joined with "\n"; otherwise lists are passed unchanged.

strftime_now is pinned to NOW (noon UTC, so the date is the same in any
timezone within +-11h); t/unit/test_chat.c renders at the same instant.

Usage: .venv/bin/python tools/gen-chat-fixtures.py   (rerunnable, deterministic)
"""
import copy
import glob
import json
import os
import sys
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOW = 1721995200  # 2024-07-26 12:00:00 UTC


class AssistantTracker(Extension):
    """transformers' {% generation %} tag: renders its body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    def _generation_support(self, caller):
        return caller()


def make_env():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.fromtimestamp(NOW).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def token_text(v):
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def load_templates():
    out = []
    for cfg_path in sorted(glob.glob(os.path.join(ROOT, "conf/tokenizers/*/tokenizer_config.json")) +
                           glob.glob(os.path.join(ROOT, "conf/templates/*/tokenizer_config.json"))):
        d = os.path.dirname(cfg_path)
        cfg = json.load(open(cfg_path, encoding="utf-8"))
        src = cfg.get("chat_template")
        if isinstance(src, list):
            src = next(t["template"] for t in src if t["name"] == "default")
        if src is None and os.path.exists(os.path.join(d, "chat_template.jinja")):
            src = open(os.path.join(d, "chat_template.jinja"), encoding="utf-8").read()
        if src is None:
            continue
        special = {}
        for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
            t = token_text(cfg.get(k))
            if t is not None:
                special[k] = t
        out.append((os.path.basename(d), os.path.relpath(cfg_path, ROOT), src, special))
    return out


def iterates_content(env, src):
    """vLLM-style detection: does some {% for %} loop over message content?"""
    ast = env.parse(src)

    def is_content(e):
        while isinstance(e, nodes.Filter):
            e = e.node
        if isinstance(e, nodes.Getattr):
            return e.attr == "content"
        if isinstance(e, nodes.Getitem):
            return isinstance(e.arg, nodes.Const) and e.arg.value == "content"
        return False

    names = set()
    for a in ast.find_all(nodes.Assign):
        if isinstance(a.target, nodes.Name) and is_content(a.node):
            names.add(a.target.name)
    for f in ast.find_all(nodes.For):
        it = f.iter
        while isinstance(it, nodes.Filter):
            it = it.node
        if is_content(it) or (isinstance(it, nodes.Name) and it.name in names):
            return True
    return False


def normalise(messages, keep_lists):
    msgs = copy.deepcopy(messages)
    if keep_lists:
        return msgs
    for m in msgs:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"]
                                     if isinstance(p, dict) and p.get("type") == "text"
                                     and isinstance(p.get("text"), str))
    return msgs


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city — «quoted» \"text\" and a\ttab",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7, "default": 1},
            "threshold": {"type": "number", "default": 0.5},
            "detailed": {"type": "boolean", "default": False},
            "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"]}}},
]

CALL_DICT = [{"id": "call12345", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius", "days": 2}}}]
CALL_STR = [{"id": "call12345", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\", \"unit\": \"celsius\"}"}}]
CALL_TWO = CALL_DICT + [{"id": "callabcde", "type": "function",
                         "function": {"name": "search", "arguments": {"query": "rain radar"}}}]


def U(c): return {"role": "user", "content": c}
def A(c): return {"role": "assistant", "content": c}
def S(c): return {"role": "system", "content": c}


CONVERSATIONS = [
    ("user_only", [U("Hello!")], None),
    ("system_user", [S("You are a helpful assistant."), U("What is 2+2?")], None),
    ("multi_turn", [S("Be brief."), U("Hi"), A("Hello! How can I help?"), U("Tell me a joke.")], None),
    ("multi_turn_no_system", [U("Hi"), A("Hello."), U("Bye"), A("Goodbye!")], None),
    ("long", [S("sys")] + [m for i in range(10) for m in (U(f"question {i}"), A(f"answer {i}"))] + [U("last")], None),
    ("unicode", [S("Réponds en français. 日本語もOK。"),
                 U("Emoji 👩‍👩‍👧‍👦 and 🇯🇵, combining é, Ελληνικά, кириллица, العربية, \"quotes\" 'single' \\backslash"),
                 A("Voilà — ✓ «ok»\n\tindented"), U("¿Y ahora? \u00a0nbsp \u200b zwsp")], None),
    ("empty_content", [U(""), A(""), U("x")], None),
    ("whitespace", [S("  padded system \n"), U("\n\n  leading and trailing  \n"), A("  spaced answer  "), U("\tq\t")], None),
    ("text_parts", [S([{"type": "text", "text": "System part."}]),
                    U([{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]),
                    A([{"type": "text", "text": "Answer part."}]), U([{"type": "text", "text": "More."}])], None),
    ("text_parts_no_system", [U([{"type": "text", "text": "Only part."}])], None),
    ("tools_user", [U("What's the weather in Zürich?")], TOOLS),
    ("tools_system", [S("You can call tools."), U("Weather in Paris?")], TOOLS),
    ("tool_call_dict", [S("Use tools."), U("Weather in Zürich?"), {"role": "assistant", "content": "", "tool_calls": CALL_DICT},
                        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "{\"temp\": 21.5, \"sky\": \"sunny\"}"},
                        A("It is 21.5 °C and sunny.")], TOOLS),
    ("tool_call_str", [U("Weather in Zürich?"), {"role": "assistant", "content": None, "tool_calls": CALL_STR},
                       {"role": "tool", "tool_call_id": "call12345", "content": "21 C"}, A("21 degrees.")], TOOLS),
    ("tool_call_two", [U("Weather and search?"), {"role": "assistant", "content": None, "tool_calls": CALL_TWO},
                       {"role": "tool", "tool_call_id": "call12345", "content": "sunny"},
                       {"role": "tool", "tool_call_id": "callabcde", "content": "no rain"}, U("thanks")], TOOLS),
    ("tool_call_no_tools", [U("Weather?"), {"role": "assistant", "content": "", "tool_calls": CALL_DICT},
                            {"role": "tool", "tool_call_id": "call12345", "content": "sunny"}], None),
    ("bad_order", [U("one"), U("two")], None),
    ("assistant_first", [A("I start."), U("ok")], None),
    ("system_only", [S("Only a system prompt.")], None),
    ("think", [U("2+2?"), A("<think>\nadd them\n</think>\n\n4"), U("and 3+3?")], None),
    ("no_think_system", [S("Be terse. /no_think"), U("hi")], None),
    ("system_override", [S("/system_override Custom only."), U("hi")], None),
    ("jinja_like_text", [U("{{ not a tag }} {% neither %} {# nor #}"), A("}} %} #}")], None),
    ("two_systems", [S("first"), S("second"), U("hi")], None),
    ("reasoning_content", [U("q1"), {"role": "assistant", "content": "a1", "reasoning_content": "thought 1"}, U("q2"),
                           {"role": "assistant", "content": "<think>\nt2\n</think>\n\na2"}], None),
    ("multi_step_tools", [U("Weather?"), {"role": "assistant", "content": "<think>plan</think>Calling.", "tool_calls": CALL_STR},
                          {"role": "tool", "tool_call_id": "call12345", "content": "sunny"},
                          {"role": "assistant", "content": "<think>done</think>It is sunny."}], TOOLS),
    # chat_template_kwargs (transformers **kwargs / vLLM chat_template_kwargs)
    ("kw_no_thinking", [S("sys"), U("hi"), A("<think>x</think>ok"), U("again")], None, {"enable_thinking": False}),
    ("kw_thinking_true", [U("hi")], None, {"enable_thinking": True}),
    ("kw_llama_tools_in_system", [S("sys"), U("Weather?")], TOOLS, {"tools_in_user_message": False, "date_string": "01 Jan 2025"}),
    ("kw_llama_builtin", [S("sys"), U("Search it"), {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call99999", "type": "function", "function": {"name": "brave_search", "arguments": {"query": "kv cache"}}}]},
        {"role": "ipython", "content": "results"}], None, {"builtin_tools": ["brave_search", "wolfram_alpha", "code_interpreter"]}),
    ("kw_override_token", [U("hi")], None, {"bos_token": "<BOS>", "eos_token": "<EOS>", "custom_var": [1, "two"]}),
]


# Single-construct checks, rendered with messages=[user "hi"], bos "<s>", eos "</s>".
SNIPPETS = [
    "plain text", "a\n{% if true %}\n  x\n{% endif %}\nb\n", "  {% if true %}x{% endif %}  \n  y",
    "{{ 1 }}  \n  {{ 2 }}\n", "{%- if true -%}  x  {%- endif -%}  y", "a  {{- 'b' -}}  c", "a  {%+ if true %}b{% endif %}",
    "{# c #}\n  {# d #}  x", "line\n    {%- set x = 1 %}\n  {{ x }}", "{% if true +%}\n  x{% endif %}",
    "x\r\ny\rz\n", "{{ 'a' ~ 1 ~ none ~ true ~ 1.5 }}", "{{ 1 + 2 * 3 - 4 / 2 }}", "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }}",
    "{{ 1.0 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1e-5 }} {{ 123456789.125 }} {{ 3 / 2 }} {{ 4 / 2 }}",
    "{{ [1, 'a', none, true, 1.5, {'k': [2]}] }}", "{{ {'a': 'it\\'s', 'b': \"q\\\"\"} }}", "{{ ('x',) }} {{ (1, 2) }}",
    "{{ 'abc'[1:] }} {{ 'abcdef'[::-1] }} {{ 'abcdef'[1:5:2] }} {{ 'héllo'[1] }} {{ 'abc'[-1] }}",
    "{{ [1,2,3,4][1:] }} {{ [1,2,3][::-1] }} {{ [1,2,3][:-1] }} {{ [1,2,3][5:] }}",
    "{{ messages[0].content }} {{ messages[0]['role'] }} {{ messages[-1].content }} {{ messages|length }}",
    "{{ x }}|{{ x is defined }}|{{ x is undefined }}|{{ x|default('d') }}|{{ none|default('d') }}|{{ ''|default('e', true) }}",
    "{{ messages[0].missing }}|{{ messages[0].missing is defined }}|{{ messages[5] is defined }}",
    "{{ 'a' in 'cat' }} {{ 'z' not in 'cat' }} {{ 1 in [1,2] }} {{ 'role' in messages[0] }} {{ 'x' in messages[0] }}",
    "{{ 1 < 2 < 3 }} {{ 3 > 2 >= 2 }} {{ 'a' < 'b' }} {{ [1,2] < [1,3] }} {{ 1 == 1.0 }} {{ 'a' != 'a' }}",
    "{{ true and 'x' }} {{ false or 'y' }} {{ not none }} {{ 0 or '' or 'z' }} {{ 1 and 0 }}",
    "{{ 'yes' if 1 else 'no' }} {{ 'yes' if 0 else 'no' }} [{{ 'only' if 0 }}]",
    "{{ '  x y  '|trim }}|{{ 'xxhixx'|trim('x') }}|{{ 'Hello'|upper }}|{{ 'HeLLo'|lower }}|{{ 'hELLO wORLD'|capitalize }}|{{ 'hello big-world'|title }}",
    "{{ 'a-b-c'|replace('-', '+') }} {{ 'aaa'|replace('a', 'b', 2) }} {{ 'abc'|replace('', '.') }}",
    "{{ [3,1,2]|first }} {{ [3,1,2]|last }} {{ 'xyz'|first }} {{ []|first }} {{ [1,2]|join(', ') }} {{ ['a','b']|join }}",
    "{{ {'b': 1, 'a': 2}|items|list }} {{ 'ab'|list }} {{ {'k': 1}|list }}",
    "{{ 42|string }} {{ '12'|int + 1 }} {{ 'x'|int }} {{ 3.9|int }} {{ '2.5'|float }} {{ -3|abs }} {{ 'abc'|length }} {{ 'é日'|length }}",
    "{{ {'a': 1, 'b': [1, 2.5, none, true], 'c': 'é\"\\n'}|tojson }}", "{{ {'a': {'b': [1, {}], 'c': []}}|tojson(indent=2) }}",
    "{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}", "{{ [1, 2]|tojson(separators=(',', ':')) }}", "{{ 'x\\u0001\\ty'|tojson }}",
    "{{ messages|selectattr('role', 'equalto', 'user')|list|length }} {{ messages|rejectattr('role', 'equalto', 'user')|list }}",
    "{{ messages|map(attribute='role')|join(',') }} {{ ['a','b']|map('upper')|list }} {{ [{'a': 1}, {}]|selectattr('a')|list }}",
    "{{ [1, 2, 3]|select('odd')|list }} {{ [1, 2, 3]|reject('odd')|list }} {{ [1, 1, 2]|unique|list }} {{ [1, 2]|reverse|list }}",
    "{{ ' a b '.strip() }}|{{ 'xxa'.lstrip('x') }}|{{ 'a\\n\\n'.rstrip() }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}",
    "{{ 'a,b,,c'.split(',') }} {{ '  a  b '.split() }} {{ 'a b c'.split(' ', 1) }} {{ 'a/b/c'.rsplit('/', 1) }} {{ 'x</think>y'.split('</think>')[-1] }}",
    "{{ 'hello world'.title() }} {{ 'Ab'.upper() }} {{ 'Ab'.lower() }} {{ 'a-b'.replace('-', '') }} {{ 'abcb'.find('b') }} {{ 'abcb'.count('b') }}",
    "{{ ', '.join(['a', 'b']) }} {{ 'abc'.capitalize() }}",
    "{% set d = {'a': 1, 'b': 2} %}{{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 9) }} {{ d.items()|list }} {{ d.keys()|list }} {{ d.values()|list }}",
    "{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}",
    "{% for x in [1, 2, 3] %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }}{{ loop.revindex0 }}|{% endfor %}",
    "{% for x in [1, 2, 3] %}{{ loop.previtem }}-{{ loop.nextitem }};{% endfor %}",
    "{% for x in [1, 2, 3, 4] if x is even %}{{ x }}{{ loop.length }}{% endfor %}",
    "{% for x in [] %}a{% else %}empty{% endfor %}", "{% for x in none %}{% endfor %}",
    "{% for x in [1, 2, 3, 4] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}",
    "{% for c in 'héj' %}[{{ c }}]{% endfor %}", "{% for k in {'a': 1, 'b': 2} %}{{ k }}{% endfor %}",
    "{% set x = 1 %}{% for i in [1, 2] %}{{ x }}{% set x = x + 10 %}{{ x }},{% endfor %}{{ x }}",
    "{% set ns = namespace(n=0, s='') %}{% for i in range(3) %}{% set ns.n = ns.n + i %}{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.n }} {{ ns.s }}",
    "{% set ns = namespace() %}{% set ns.a = 'v' %}{{ ns.a }}", "{% set a, b = [1, 2] %}{{ a }}{{ b }}", "{% set a, b = 'xy' %}{{ b }}{{ a }}",
    "{% set x %}inner {{ 1 + 1 }}{% endset %}[{{ x }}]", "{% if false %}a{% elif 0 %}b{% elif 'x' %}c{% else %}d{% endif %}",
    "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Bo') }} {{ greet('Al', punct='?') }} {{ greet(name='Cy') }}",
    "{{ range(3)|list }} {{ range(1, 7, 2)|list }} {{ range(3, 0, -1)|list }}",
    "{{ bos_token }}{{ eos_token }}{{ add_generation_prompt }}{{ tools }}{{ tools is none }}{{ documents }}",
    "{{ none }} {{ true }} {{ True }} {{ false }} {{ none is none }} {{ 1 is number }} {{ 'a' is string }} {{ {} is mapping }} {{ [] is iterable }} {{ 'a' is sequence }}",
    "{{ 1 is integer }} {{ 1.5 is float }} {{ true is boolean }} {{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 1 is in [1] }} {{ 'A' is upper }} {{ 'a' is lower }}",
    "{{ 'x' is true }} {{ true is true }} {{ false is false }} {{ 1 is sameas 1 }} {{ 1 is eq 1 }} {{ 1 is ne 2 }} {{ 2 is gt 1 }} {{ raise_exception is callable }}",
    "{{ 'ab' * 3 }} {{ [1] * 2 }} {{ [1] + [2] }} {{ -(3) }} {{ +4 }} {{ 'a' 'b' }}",
    "{{ \"\\x41\\u00e9\\U0001F600\\101\\q\" }}", "{{ 'multi\nline' }}",
    "{% generation %}gen {{ 1 }}{% endgeneration %}", "{{ strftime_now('%d %B %Y, %a %b %H:%M') }}",
    "{{ '%' }}{{ messages[0] }}", "{{ [{'a': 'x\\ny', 'b': \"it's\"}] }}", "{{ {'k': 'a\\u00a0b\\u200dc\\x7f'} }}",
    "{{ 1 ~ 2 + 3 }} {{ 'a' ~ 'b' | upper }} {{ not 1 == 2 }} {{ -2 ** 2 }}",
    "{{ messages[0].content.upper() }} {{ messages[0]['content'][0] }}", "{{ [1, [2, 3]][1][0] }} {{ {'a': {'b': 'c'}}.a.b }}",
    # whitespace control corner cases
    "a\n\t {% if true %}x{% endif %}\n", "a {% if true %}x{% endif %}", "\n  {% if true %}\n  x\n  {% endif %}\n",
    "{% if true %}a{% endif %}\n\nb", "x  {#- c -#}  y", "{{ 1 -}}\n\n{{- 2 }}", "a\n  {%- if true %} b {% endif -%}\n  c",
    "{% for i in [1,2] %}\n  - {{ i }}\n{% endfor %}\n", "{% for i in [1,2] -%}\n  {{ i }}\n{%- endfor %}",
    "  {{ 'v' }}  {% if true %}\n", "{% if true %}   \n x{% endif %}", "{%+ if true %}a{% endif %}\n  {%+ if true %}b{% endif %}",
    "\n\n", "x\n", "x\n\n", "{{ 'a' }}\n", "{% if true %}x{% endif %}\n",
    # numbers and repr
    "{{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 0.00001 }} {{ 1.5e-7 }} {{ -0.0 }} {{ 100.0 }} {{ 1 / 3 }} {{ 2.5e300 * 10 }}",
    "{{ 10 / 4 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ 2 ** -1 }} {{ 3 * 1.5 }} {{ 1_000 }}",
    "{{ ['a\"b', \"a'b\", 'a\\'b\"c', '\\\\', '\\x00', 'ü', '\\u2028'] }}",
    "{{ {1: 'int key', none: 'n', true: 't'} }}", "{{ {'a': 1, 'a': 2} }}", "{{ {'t': (1, 2)}|tojson }} {{ (1,)|tojson }}",
    "{{ {'a': [1, {'b': []}], 'c': {}}|tojson(indent=4) }}", "{{ [[], {}]|tojson(indent=0) }}", "{{ 'é😀'|tojson }} {{ 1.0|tojson }} {{ 1e20|tojson }}",
    "{{ {1: 2, true: 3}|tojson }}",
    # strings
    "{{ '\u3000x\u00a0'|trim }}|{{ ' x '|trim|length }}", "{{ 'ab cd'.split(none) }} {{ ' a b  c '.split(none, 1) }} {{ 'a\\nb\\r\\nc'.split() }}",
    "{{ \"they're bill's\".title() }} {{ 'hello WORLD 2day'.title() }} {{ 'ÀÉÎ'.lower() }} {{ 'éñ'.upper() }} {{ 'привет'.upper() }}",
    "{{ 'abc'.replace('', '-') }} {{ 'aaaa'.replace('aa', 'b') }} {{ 'abc'.find('z') }} {{ 'a日b'.find('b') }}",
    "{{ 'x'.startswith('') }} {{ ''.endswith('') }} {{ 'abc'.strip('ca') }} {{ '  '.strip() == '' }}",
    "{{ 'abc'[10] is defined }} {{ 'abc'[-10:] }} {{ 'abc'[:-10] }} {{ [1,2,3][-2:] }} {{ [1,2,3,4,5][::2] }} {{ [1,2,3,4,5][4:1:-1] }}",
    "{{ 'abc' < 'abd' }} {{ 'B' < 'a' }} {{ 'é' > 'z' }}",
    # undefined and none
    "{{ x|length }} {{ x|list }} {{ x|trim }} {{ x|string }} {{ x|upper }} {{ x == none }} {{ x is none }} {{ not x }} [{% for i in x %}{{ i }}{% endfor %}]",
    "{{ none|string }} {{ none|trim }} {{ none is defined }} {{ messages[0].content.missing is defined }}",
    "{{ messages[0].items is defined }}", "{% for x in 'abc' %}{{ loop.cycle('o', 'e') }}{% endfor %}", "{{ messages[0]['role'].x }}|{{ (messages[0].nope or 'alt') }}",
    # loops and scopes
    "{% for a in [1, 2] %}{% for b in 'xy' %}{{ loop.index }}{{ a }}{{ b }} {% endfor %}{{ loop.index }}|{% endfor %}",
    "{% for i in range(3) %}{% set y = i %}{% endfor %}[{{ y }}]", "{% if true %}{% set z = 5 %}{% endif %}{{ z }}",
    "{% set items = [3, 1] %}{% for i in items %}{{ loop.cycle is defined }}{% endfor %}",
    "{% for m in messages %}{% set messages = [] %}{{ m.role }}{% endfor %}{{ messages|length }}",
    "{% set messages = messages + [{'role': 'x', 'content': 'y'}] %}{{ messages|length }} {{ messages[-1].role }}",
    "{% macro outer() %}[{% for i in [1,2] %}{{ inner(i) }}{% endfor %}]{% endmacro %}{% macro inner(x) %}<{{ x }}>{% endmacro %}{{ outer() }}",
    "{% macro m() %}{{ mv }}{% endmacro %}{% set mv = 'top' %}{{ m() }}",
    "{% for x in [1,2,3] %}{% if loop.first %}F{% elif loop.last %}L{% else %}M{% endif %}{% endfor %}",
    "{% for x in [1] %}{% break %}never{% endfor %}done", "{% for x in [1,2] %}{% for y in [1,2] %}{% if y == 2 %}{% break %}{% endif %}{{ x }}{{ y }}{% endfor %}{% endfor %}",
    # tests with arguments and filters with kwargs
    "{{ [1, 2, 3]|select('gt', 1)|list }} {{ messages|selectattr('content')|list|length }} {{ messages|map(attribute='nope', default='D')|list }}",
    "{{ [{'f': {'n': 'a'}}, {'f': {'n': 'b'}}]|map(attribute='f.n')|join('+') }} {{ ['x', 'y']|join(d='-') }} {{ [1, 2]|join }}",
    "{{ 'abc'|default('z') }} {{ x|d('dd') }} {{ 0|default(5, true) }} {{ false|default('f', boolean=true) }}",
    "{{ [1]|first is number }} {{ {'a': 1}|first }} {{ {'a': 1}|last }}",
    "{{ 'x' is in 'xyz' }} {{ 3 is divisibleby(3) }} {{ none is sameas none }} {{ 'a' is not string }}",
    "{{ 'ab'|reverse }} {{ (1, 2)|list }} {{ '-5'|int|abs }} {{ ' 12 '|int }} {{ '0x1A'|int }} {{ '1e3'|int }} {{ true|int }}",
    "{{ range(0)|list }} {{ range(-3)|list }} {{ range(5, 1)|list }} {{ range(0, 10, 3)|list }}",
    "{{ dict(a=1, b='x') }} {{ dict({'k': 2}, z=3) }} {{ namespace(a=1).a }}",
    "{{ ('a', 'b') == ('a', 'b') }} {{ ['a'] == ('a',) }} {{ {'a': 1} == {'a': 1} }} {{ 1 == true }} {{ 0 == false }}",
    "{{ {'b': 1, 'A': 2, 'c': 0}|dictsort }} {{ {'b': 1, 'A': 2, 'c': 0}|dictsort(true) }} {{ {'b': 1, 'a': 2}|dictsort(by='value', reverse=true) }}",
    "{{ [3, 1, 2]|sort }} {{ ['b', 'A', 'c']|sort }} {{ ['b', 'A', 'c']|sort(case_sensitive=true) }} {{ [3, 1, 2]|sort(true) }} {{ messages|sort(attribute='role')|map(attribute='role')|list }}",
    "{% for k, v in {'z': 1, 'y': {'q': 2}}|dictsort %}{{ k }}={{ v }};{% endfor %} {{ [[2, 'a'], [1, 'b'], [2, 'A']]|sort }}",
    "[{{ 'a\nb\n\nc'|indent }}] [{{ 'a\n'|indent(2) }}] [{{ 'a\n'|indent(2, blank=true) }}] [{{ ''|indent }}] [{{ 'x\r\ny'|indent('> ', true) }}] [{{ 'a\n\nb'|indent(1, true, true) }}]",
    "{{ {'a': [1, 2]}|tojson(indent=2)|indent(4) }}", "{{ '<a>&x'|e }} {{ messages|tojson|escape }} {{ 'it&apos;s'|e }}",
    "{{ [1, 2, 3.5]|sum }} {{ messages|sum(attribute='n', start=5) if false else [{'n': 2}, {'n': 3}]|sum(attribute='n') }} {{ [3, 1, 2]|min }} {{ ['b', 'A', 'c']|max }} {{ []|max }}",
    "{{ 'abcdefgh'[1:7:3] }} {{ 'abcdefgh'[::-3] }} {{ [1,2,3,4,5][::-2] }} {{ [1,2][::9223372036854775807] }} {{ 'ab'[-9223372036854775807:] }} {{ range(-5, 5, 4)|list }} {{ range(5, -5, -3)|list }} {{ 2 ** 62 }} {{ -(2 ** 62) }}",
    "{% set t = ('x', 'y') %}{{ t[0] }}{{ t[-1] }}{{ t|length }}{{ t }}{% for a in t %}{{ a }}{% endfor %}",
    "{{ raise_exception('boom') }}", "{{ undefined_var.attr }}", "{{ 'a' + 1 }}", "{{ none + 'a' }}", "{{ x + 'a' }}",
    "{{ 1 in none }}", "{% for x in 5 %}{% endfor %}", "{{ {}|tojson(ensure_ascii=false) }}{{ x|tojson }}",
    "{% set l = [1] %}{{ l.append(2) }}", "{{ range(100001)|length }}", "{{ 'abc'.strip(1) }}",
]


def main():
    env = make_env()
    outdir = os.path.join(ROOT, "t/data/chat")
    os.makedirs(outdir, exist_ok=True)
    index = []
    for name, cfg_rel, src, special in load_templates():
        tpl = env.from_string(src)
        keep_lists = iterates_content(env, src)
        lines = []
        for conv, messages, tools, *kw in CONVERSATIONS:
            kwargs = kw[0] if kw else None
            for agp in (False, True):
                rec = {"conv": conv, "add_generation_prompt": agp, "messages": messages, "tools": tools}
                if kwargs:
                    rec["kwargs"] = kwargs
                try:
                    # transformers: template_kwargs = {**special_tokens_map, **kwargs}
                    rec["output"] = tpl.render(messages=normalise(messages, keep_lists), tools=copy.deepcopy(tools),
                                               documents=None, add_generation_prompt=agp,
                                               **{**special, **copy.deepcopy(kwargs or {})})
                except Exception as e:  # noqa: BLE001 - every failure is an expected error
                    rec["error"] = f"{type(e).__name__}: {e}"
                lines.append(json.dumps(rec, ensure_ascii=False))
        path = os.path.join(outdir, name + ".jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        index.append({"name": name, "config": cfg_rel, "cases": len(lines),
                      "errors": sum('"error"' in l for l in lines), "content_parts": keep_lists})
    lines = []
    for src in SNIPPETS:
        rec = {"template": src}
        try:
            rec["output"] = env.from_string(src).render(messages=[{"role": "user", "content": "hi"}], tools=None,
                                                        documents=None, add_generation_prompt=False,
                                                        bos_token="<s>", eos_token="</s>")
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"
        lines.append(json.dumps(rec, ensure_ascii=False))
    with open(os.path.join(outdir, "snippets.jsonl"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(outdir, "index.json"), "w", encoding="utf-8") as f:
        json.dump({"now": NOW, "jinja2": jinja2.__version__, "templates": index}, f, indent=1)
        f.write("\n")
    for t in index:
        print(f"{t['name']:28} {t['cases']:3} cases, {t['errors']:3} expected errors, content_parts={t['content_parts']}")


if __name__ == "__main__":
    sys.exit(main())
