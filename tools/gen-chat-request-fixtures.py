#!/usr/bin/env python3
"""Chat *request* fixtures: what vLLM's OpenAI server (and SGLang's) renders
for a whole chat completion request, not only its `messages`, over every
shipped template. Writes t/data/chat/requests.jsonl: one line per (template,
request) with the request body as the client sends it (JSON text) and the
expected prompt text or error.

vLLM's steps are mirrored here in plain Python from its source
(vllm/entrypoints/chat_utils.py, openai/protocol.py, serving_chat.py):

  - tools: ChatCompletionToolsParam(**tool).model_dump() with vLLM's own
    pydantic models (extra members allowed), so absent description and
    parameters become null and extra members follow the declared ones;
  - messages: _parse_chat_message_content (role, content, tool_calls,
    reasoning / reasoning_content, tool_call_id, name; the rest dropped;
    parts joined with "\\n" for "string" templates, strings wrapped as text
    parts for templates that loop over content; null content "" or []);
  - _postprocess_messages: empty tool_calls dropped, arguments parsed from
    JSON text into a dict (malformed, null or not an object: {});
  - chat_template_kwargs, documents and add_generation_prompt as template
    variables; continue_final_message cuts the text as transformers does.

SGLang's steps (serving_chat.py _process_messages / _apply_jinja_template,
jinja_template_utils.process_content_for_template_format, protocol.py's
models) are mirrored the same way in render_sglang: its message models'
dumps with None members dropped, parts joined with " ", arguments parsed,
each tool's `function` alone (none when tool_choice is "none", only the
named one for a named choice), add_generation_prompt always, and
reasoning_effort (default "medium") beside chat_template_kwargs; for
continue_final_message the last assistant message is left out (SGLang
appends that text's own tokens after the render, which the router does not
hash).

Rendering uses tools/gen-chat-fixtures.py's jinja2 environment (the one
transformers sets up). t/unit/test_chat_request.c checks kvroute against
this file on the router's path (kv_body + kv_chat_render_request) and on
kvworker's (kv_chat_render_request_json).

Usage: .venv/bin/python tools/gen-chat-request-fixtures.py   (deterministic)
"""
import copy
import importlib.util
import json
import os
import sys
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("chatfix", os.path.join(HERE, "gen-chat-fixtures.py"))
chatfix = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chatfix)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
             "thinking": "thinking"}
KNOWN_PART_KEYS = {"type", "text", "refusal", "thinking", "closed", "uuid"}


def parse_part(p, openai_format):
    """_parse_chat_message_content_part for text kinds; other parts as they came."""
    if isinstance(p, str):
        return {"type": "text", "text": p} if openai_format else p
    key = TEXT_KEYS.get(p.get("type"))
    if key is None:
        return p if openai_format else None
    text = p.get(key)
    if text is None:
        return None
    if not openai_format:
        return text
    return {"type": "text", "text": text, **{k: v for k, v in p.items() if k not in KNOWN_PART_KEYS}}


def parse_message(msg, openai_format):
    role = msg["role"]
    content = msg.get("content")
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [{"type": "text", "text": content}]
    parts = [q for q in (parse_part(p, openai_format) for p in content) if q is not None]
    out = {"role": role, "content": parts if openai_format else "\n".join(parts)}
    if role == "tool" and openai_format and all(isinstance(q, dict) and q.get("type") == "text"
                                                for q in parts):
        out["content"] = "\n".join(q.get("text", "") for q in parts) if parts else ""
    if role == "assistant":
        if msg.get("tool_calls") is not None:
            out["tool_calls"] = copy.deepcopy(list(msg["tool_calls"]))
        reasoning = msg.get("reasoning")
        if reasoning is None:
            reasoning = msg.get("reasoning_content")
        if reasoning is not None:
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in msg:
        out["tool_call_id"] = msg["tool_call_id"]
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    return out


def postprocess(conv):
    for m in conv:
        if m["role"] != "assistant" or not isinstance(m.get("tool_calls"), list):
            continue
        if not m["tool_calls"]:
            del m["tool_calls"]
            continue
        for item in m["tool_calls"]:
            fn = item["function"]
            args = fn.get("arguments")
            parsed = {}
            if isinstance(args, dict):
                parsed = args
            elif isinstance(args, str) and args:
                try:
                    parsed = json.loads(args)
                except json.JSONDecodeError:
                    parsed = {}
            fn["arguments"] = parsed if isinstance(parsed, dict) else {}


def cut_final(text, final):
    """transformers' continue_final_message."""
    if isinstance(final, list):
        final = next(p["text"] for p in reversed(final) if "text" in p)
    if final.strip() not in text:
        raise ValueError("the final message does not appear in the chat")
    loc = text.rindex(final.strip())
    if text[loc:loc + len(final.lstrip())] == final:
        return text[:loc + len(final.lstrip())]
    return text[:loc + len(final.strip())]


def render(env, src, special, openai_format, req):
    conv = [parse_message(m, openai_format) for m in req["messages"]]
    postprocess(conv)
    tools = None
    if req.get("tools") is not None:
        tools = [ChatCompletionToolsParam(**t).model_dump() for t in req["tools"]]
    cont = bool(req.get("continue_final_message", False))
    agp = req.get("add_generation_prompt", True)
    kwargs = req.get("chat_template_kwargs") or {}
    text = env.from_string(src).render(messages=conv, tools=tools, documents=req.get("documents"),
                                       add_generation_prompt=agp,
                                       **{**special, **copy.deepcopy(kwargs)})
    if cont:
        text = cut_final(text, conv[-1]["content"])
    return text


# SGLang's request models (python/sglang/srt/entrypoints/openai/protocol.py)
class SgFunction(BaseModel):
    description: Optional[str] = None
    name: str
    parameters: Optional[object] = None
    strict: bool = False


class SgTool(BaseModel):
    type: str = "function"
    function: SgFunction


def sglang_message(msg, openai_format):
    """SGLang's message.model_dump() (its pydantic models' members, in their
    order), content None -> "", then process_content_for_template_format
    (None members dropped; parts joined with " " for "string" templates)."""
    role = msg["role"]
    content = msg.get("content")
    if content is None:
        content = ""
    if role == "user":
        d = {"role": role, "content": content}
    else:
        d = {"role": role, "content": content, "tool_call_id": msg.get("tool_call_id"),
             "name": msg.get("name"), "reasoning_content": msg.get("reasoning_content"),
             "tool_calls": None}
        if msg.get("tool_calls") is not None:
            d["tool_calls"] = [{"id": c.get("id"), "index": c.get("index"), "type": "function",
                                "function": {"name": c["function"].get("name"),
                                             "arguments": c["function"].get("arguments")}}
                               for c in msg["tool_calls"]]
    if isinstance(d["content"], list):
        if openai_format:
            d["content"] = [{"type": "text", "text": p["text"]} if p.get("type") == "text" else p
                            for p in d["content"]]
        else:
            texts = [p["text"] for p in d["content"] if isinstance(p, dict) and p.get("type") == "text"]
            d["content"] = " ".join(texts) if texts else ""
    d = {k: v for k, v in d.items() if v is not None}
    for c in d.get("tool_calls", []) if d["role"] == "assistant" else []:
        if isinstance(c["function"].get("arguments"), str):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return d


def render_sglang(env, src, special, openai_format, req):
    conv = [sglang_message(m, openai_format) for m in req["messages"]]
    if req.get("continue_final_message") and conv and conv[-1]["role"] == "assistant":
        conv = conv[:-1]        # SGLang appends the prefix's own tokens after the render
    tools = None
    choice = req.get("tool_choice") or ("none" if req.get("tools") is None else "auto")
    if req.get("tools") and choice != "none":
        tools = [SgTool(**t).function.model_dump() for t in req["tools"]
                 if isinstance(choice, str) or t["function"]["name"] == choice["function"]["name"]]
    kwargs = {"reasoning_effort": req.get("reasoning_effort", "medium"),
              **(req.get("chat_template_kwargs") or {})}
    return env.from_string(src).render(messages=conv, tools=tools, documents=None,
                                       add_generation_prompt=True, **{**special, **kwargs})


TOOL_MIN = {"type": "function", "function": {"name": "ping"}}
TOOL_EXTRA = {"function": {"parameters": {"type": "object", "properties": {"x": {"type": "number", "minimum": 0.5,
                                                                                    "maximum": 1e3}}},
                           "strict": True, "name": "scale", "description": "Scale by x."},
              "type": "function", "x-extra": [1, 2]}
CALL = {"id": "call1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Zürich\",\"days\":2,\"t\":1.50}"}}


def call(args, cid="call1", name="get_weather"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


U = chatfix.U
S = chatfix.S


def A(c, **kw):
    return {"role": "assistant", "content": c, **kw}


REQUESTS = [
    ("plain", {"messages": [S("Be brief."), U("Hi")]}),
    ("tools", {"messages": [U("Weather in Zürich?")], "tools": chatfix.TOOLS}),
    ("tools_system", {"messages": [S("You can call tools."), U("Weather?")], "tools": chatfix.TOOLS,
                      "tool_choice": "auto"}),
    ("tools_min_extra", {"messages": [U("go")], "tools": [TOOL_MIN, TOOL_EXTRA]}),
    ("tools_choice_none", {"messages": [U("no tools now")], "tools": chatfix.TOOLS, "tool_choice": "none"}),
    ("call_compact", {"messages": [U("Weather?"), A(None, tool_calls=[CALL]),
                                   {"role": "tool", "tool_call_id": "call1", "content": "sunny"}, U("thanks")],
                      "tools": chatfix.TOOLS}),
    ("call_bad_args", {"messages": [U("w?"), A("", tool_calls=[call("{not json"), call("[1, 2]", "call2"),
                                                                  call("", "call3")]),
                                    {"role": "tool", "tool_call_id": "call1", "content": "x"}],
                       "tools": chatfix.TOOLS}),
    ("call_empty_list", {"messages": [U("a"), A("plain answer", tool_calls=[]), U("b")]}),
    ("extra_keys", {"messages": [{"role": "system", "content": "sys", "name": "ops", "x": 1},
                                 {"role": "user", "content": "hi"},
                                 A("a1", refusal=None, audio=None, reasoning_content="thought"),
                                 U("again")]}),
    ("reasoning", {"messages": [U("q1"), A("a1", reasoning="why 1"), U("q2")]}),
    ("null_content", {"messages": [U("x"), A(None), U("y")]}),
    ("parts", {"messages": [U([{"type": "text", "text": "one"}, {"type": "text", "text": "two"}])]}),
    ("part_kinds", {"messages": [
        S([{"type": "input_text", "text": "sys in"}, "plain string part",
           {"type": "text", "text": "cached", "cache_control": {"type": "ephemeral"}}]),
        U([{"type": "text", "text": None}, {"type": "output_text", "text": "out"}]),
        A([{"type": "refusal", "refusal": "no"}, {"type": "thinking", "thinking": "hmm"}]),
        U("next")]}),
    ("tool_parts", {"messages": [U("w?"), A(None, tool_calls=[call("{}")]),
                                 {"role": "tool", "tool_call_id": "call1",
                                  "content": [{"type": "text", "text": "line 1"},
                                              {"type": "text", "text": "line 2"}]}],
                    "tools": chatfix.TOOLS}),
    ("kwargs", {"messages": [S("sys"), U("hi")], "chat_template_kwargs": {"enable_thinking": False}}),
    ("no_gen_prompt", {"messages": [U("hi"), A("hello")], "add_generation_prompt": False}),
    ("continue", {"messages": [U("Write a haiku."), A("Autumn moon  ")], "add_generation_prompt": False,
                  "continue_final_message": True}),
    ("documents", {"messages": [U("Summarise.")], "documents": [{"title": "A", "text": "alpha"}]}),
    ("named_choice", {"messages": [U("use search")], "tools": chatfix.TOOLS,
                      "tool_choice": {"type": "function", "function": {"name": "search"}}}),
    ("floats", {"messages": [U("f")], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"v": {"default": 1e-7, "maximum": 2.50}}}}}]}),
]


def main():
    env = chatfix.make_env()
    lines = []
    for name, cfg_rel, src, special in chatfix.load_templates():
        openai_format = chatfix.iterates_content(env, src)
        for engine, fn in (("vllm", render), ("sglang", render_sglang)):
            for case, req in REQUESTS:
                if engine == "sglang" and case in ("call_bad_args", "part_kinds"):
                    continue        # SGLang refuses these (orjson raises; its part models)
                body = json.dumps({"model": "m", **req}, ensure_ascii=False, separators=(",", ":"))
                rec = {"template": name, "engine": engine, "case": case, "body": body}
                try:
                    rec["output"] = fn(env, src, special, openai_format, json.loads(body))
                except Exception as e:  # noqa: BLE001 - every failure is an expected error
                    rec["error"] = f"{type(e).__name__}: {e}"
                lines.append(json.dumps(rec, ensure_ascii=False))
    path = os.path.join(chatfix.ROOT, "t/data/chat/requests.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    errors = sum('"error"' in line for line in lines)
    print(f"{len(lines)} cases, {errors} expected errors -> {path}")


if __name__ == "__main__":
    sys.exit(main())
