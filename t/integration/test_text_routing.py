"""Text and chat prompts: nginx and kvworker tokenize with the same
tokenizer.json and chat template (src/text), so a prefix the worker cached
is found by the router. Real nginx, nats-server, kvworker."""
import concurrent.futures
import json
import os

import kvt

QWEN = os.path.join(kvt.TOP, "conf", "tokenizers", "qwen2.5-instruct")

CONF = """
    kvroute_zone kv 16m;
    kvroute_events %(nats)s zone=kv;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv tokenizer=%(dir)s/tokenizer.json chat_template=%(dir)s/tokenizer_config.json
                thread_threshold=%(threshold)s %(extra)s;
        %(servers)s
        keepalive 8;
    }
    server {
        listen 127.0.0.1:%%(port)s;
        client_body_buffer_size 4m;
        client_max_body_size 8m;
        location /v1/ {
            kvroute_upstream llm;
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            kvroute_debug_headers on;
            add_header X-KVRoute-Fallback $kvroute_fallback always;
            add_header X-KVRoute-Prompt-Tokens $kvroute_prompt_tokens always;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""

SYSTEM = ("You are a meticulous assistant for a large insurance company. " * 40).strip()


def setup(stack, threshold="64k", extra="", worker_extra=(), tok=QWEN):
    nats = stack.nats()
    w = stack.worker(engines=2, extra=["--speedup", "50", "--nats", nats.url, "--heartbeat-ms", "200",
                                       "--tokenizer", tok + "/tokenizer.json",
                                       "--chat-template", tok + "/tokenizer_config.json",
                                       *worker_extra], wait=False)
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
    # nginx loads its tokenizer while the worker loads its own
    ng = stack.nginx(CONF % {"nats": nats.url, "dir": tok, "servers": servers,
                             "threshold": threshold, "extra": extra})
    stack.ready(w)
    def live():
        s, _, body = kvt.request(ng.port, "GET", "/kvroute/status")
        ws = json.loads(body)["zones"]["kv"]["events"]["workers"]
        return len([x for x in ws if x["state"] == "live"]) == 2
    kvt.wait_until(live, what="workers announced")
    return ng, w.ports


def indexed(port, server):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    for x in json.loads(body)["zones"]["kv"]["upstreams"]["llm"]:
        if x["server"] == server:
            return x["indexed_blocks"]


def chat_body(question):
    return {"model": "kvroute-mock", "max_tokens": 2,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}]}


def chat_cached(stack):
    """A stack whose first worker cached (and indexed) chat_body's prompt:
    nginx, the two workers' ports and that prompt's tokens."""
    ng, (a, b) = setup(stack)
    s, h, body, _ = kvt.post_json(a, "/v1/chat/completions", chat_body("First question?"))
    assert s == 200, body
    prompt_tokens = body["usage"]["prompt_tokens"]
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= prompt_tokens // 16,
                   what="chat blocks indexed")
    return ng, (a, b), prompt_tokens


def test_chat_prefix_found_by_router(stack):
    ng, (a, b) = setup(stack)
    s, h, body, _ = kvt.post_json(a, "/v1/chat/completions", chat_body("First question?"))
    assert s == 200, body
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert prompt_tokens > 300
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= prompt_tokens // 16,
                   what="chat blocks indexed")
    for q in ("Second question?", "Third one, please."):
        s, h, body, _ = kvt.post_json(ng.port, "/v1/chat/completions", chat_body(q))
        assert s == 200
        assert h["x-kvroute-worker"] == "127.0.0.1:%d" % a
        # the shared system prompt: every full block before the question
        assert int(h["x-kvroute-overlap"]) >= (prompt_tokens - 20) // 16
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * int(h["x-kvroute-overlap"])



def test_responses_api_routes_on_the_engines_blocks(stack):
    """A Responses API request (instructions + input, the history in input
    as vLLM needs it without a store) is rendered as the chat request vLLM
    makes of it: the blocks a worker cached for that chat are found for it,
    and the worker (rendering the Responses request the same way) serves
    them from its cache."""
    ng, (a, b), prompt_tokens = chat_cached(stack)
    for req in ({"model": "kvroute-mock", "instructions": SYSTEM, "input": "Second question?"},
                {"model": "kvroute-mock", "instructions": SYSTEM, "max_output_tokens": 4,
                 "input": [{"role": "user", "content": [{"type": "input_text",
                                                         "text": "First question?"}]},
                           {"type": "message", "role": "assistant", "id": "msg_1",
                            "content": [{"type": "output_text", "text": "Yes."}]},
                           {"type": "reasoning", "id": "rs_1", "summary": []},
                           {"role": "user", "content": "Third one?"}]}):
        s, h, body, _ = kvt.post_json(ng.port, "/v1/responses", req)
        assert s == 200, body
        assert h["x-kvroute-worker"] == "127.0.0.1:%d" % a
        assert h.get("x-kvroute-fallback", "") == ""
        assert int(h["x-kvroute-overlap"]) >= (prompt_tokens - 20) // 16
        assert body["usage"]["input_tokens_details"]["cached_tokens"] >= \
            16 * int(h["x-kvroute-overlap"])
    assert ng.alerts() == []


def test_nul_characters_count_alike(stack):
    """"\u0000" is valid JSON (a mock model's output can hold one, and the
    client echoes it back next turn): the worker takes it, as vLLM does, and
    the router counts the same prompt tokens for it, in a chat, a Responses
    request and a completion."""
    ng, _ = setup(stack)
    for path, body in (
            ("/v1/chat/completions", {"max_tokens": 1, "messages": [
                {"role": "user", "content": "x"}, {"role": "assistant", "content": "y\u0000z"},
                {"role": "user", "content": "w\u0000"}]}),
            ("/v1/responses", {"max_output_tokens": 1, "input": [
                {"role": "user", "content": "x"}, {"role": "assistant", "content": "y\u0000z"}]}),
            ("/v1/completions", {"max_tokens": 1, "prompt": "a\u0000b"})):
        s, h, out, raw = kvt.post_json(ng.port, path, body)
        assert s == 200, raw
        usage = out["usage"]
        assert int(h["x-kvroute-prompt-tokens"]) == usage.get("prompt_tokens",
                                                             usage.get("input_tokens")), (path, h.get("x-kvroute-fallback"))
    assert ng.alerts() == []

TOOLS = [{"type": "function", "function": {
    "name": "lookup_policy_%d" % i,
    "description": "Look up clause %d of an insurance policy by its number and holder." % i,
    "parameters": {"type": "object", "required": ["policy"],
                   "properties": {"policy": {"type": "string", "description": "policy number"},
                                  "holder": {"type": "string"}, "limit": {"type": "number", "default": 2.5}}}}}
    for i in range(12)]


def agent_body(turns):
    msgs = [{"role": "system", "content": "You handle claims."},
            {"role": "user", "content": "Check policy 4411 for water damage."}]
    if turns > 1:
        # a call as the client echoes it back: compact JSON text that the
        # engine parses before the template prints it
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": "call_1", "type": "function", "function": {
                         "name": "lookup_policy_3", "arguments": "{\"policy\":\"4411\",\"limit\":3}"}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "Clause 3 covers water damage."},
                 {"role": "user", "content": "And fire?"}]
    if turns > 2:
        msgs += [{"role": "assistant", "content": "Fire is covered by clause 5."},
                 {"role": "user", "content": "Thanks, file it."}]
    return {"model": "kvroute-mock", "max_tokens": 2, "tools": TOOLS, "tool_choice": "auto",
            "messages": msgs}


def agent_turns_found(stack, extra="", worker_extra=()):
    ng, (a, b) = setup(stack, extra=extra, worker_extra=worker_extra)
    s, _, body, _ = kvt.post_json(a, "/v1/chat/completions", agent_body(1))
    assert s == 200, body
    first = body["usage"]["prompt_tokens"]
    assert first > 700                  # the tool schemas are in the prompt
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= first // 16,
                   what="first turn indexed")
    last = first
    for turns in (2, 3):
        s, h, body, _ = kvt.post_json(ng.port, "/v1/chat/completions", agent_body(turns))
        assert s == 200, body
        assert h["x-kvroute-worker"] == "127.0.0.1:%d" % a
        assert int(h["x-kvroute-overlap"]) >= last // 16 - 1
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * int(h["x-kvroute-overlap"])
        last = body["usage"]["prompt_tokens"]
        kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= last // 16,
                       what="turn %d indexed" % turns)



def test_anthropic_messages_route_on_the_engines_blocks(stack):
    """The Anthropic Messages API (/v1/messages: Claude Code and the
    Anthropic SDKs, which vLLM serves) through the official `anthropic`
    client: the request is rendered as the chat request vLLM makes of it
    (its `system` first, without Claude Code's per-request billing header;
    tool_use and tool_result blocks as tool calls and tool messages), so the
    blocks a worker cached for the equivalent chat are found for it, and an
    agent's next turn finds every block of the last one, streamed or not.
    It used to be rendered without its system prompt: no block matched."""
    import anthropic
    ng, (a, b), prompt_tokens = chat_cached(stack)
    c = anthropic.Anthropic(base_url="http://127.0.0.1:%d" % ng.port, api_key="none",
                            max_retries=0, timeout=30)
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=%d" % i}
              for i in range(2)]
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]

    def create(history, i, **kw):
        raw = c.messages.with_raw_response.create(
            model="kvroute-mock", max_tokens=2, messages=history,
            system=[system[i % 2], {"type": "text", "text": SYSTEM}], **kw)
        return raw.headers, raw.parse()

    h, m = create([{"role": "user", "content": "Second question?"}], 0)
    assert h["x-kvroute-worker"] == "127.0.0.1:%d" % a
    assert h.get("x-kvroute-fallback", "") == ""
    assert int(h["x-kvroute-overlap"]) >= (prompt_tokens - 20) // 16
    assert m.usage.cache_read_input_tokens >= 16 * int(h["x-kvroute-overlap"])

    history = [{"role": "user", "content": [{"type": "text", "text": "Check policy 4411."}]}]
    h, m = create(history, 1, tools=tools)
    assert h["x-kvroute-worker"] == "127.0.0.1:%d" % a
    last = m.usage.input_tokens
    assert last > prompt_tokens + 500           # the tool schemas are in the prompt
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= last // 16,
                   what="first agent turn indexed")
    history += [{"role": "assistant", "content": [
                    {"type": "text", "text": "Looking it up."},
                    {"type": "tool_use", "id": "toolu_01", "name": "lookup_policy_3",
                     "input": {"policy": "4411", "limit": 3}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01",
                     "content": [{"type": "text", "text": "Clause 3 covers water damage."}]},
                    {"type": "text", "text": "And fire?"}]}]
    h, m = create(history, 0, tools=tools)
    assert h["x-kvroute-worker"] == "127.0.0.1:%d" % a
    assert int(h["x-kvroute-overlap"]) >= last // 16 - 1
    assert m.usage.cache_read_input_tokens >= 16 * int(h["x-kvroute-overlap"])
    # streamed, as Claude Code asks
    with c.messages.stream(model="kvroute-mock", max_tokens=3, messages=history, tools=tools,
                           system=[system[1], {"type": "text", "text": SYSTEM}]) as st:
        text = "".join(st.text_stream)
        final = st.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 3
    assert final.content[0].text == text and final.usage.cache_read_input_tokens >= last - 16
    assert ng.alerts() == []

def test_anthropic_tool_input_past_64_bits_routes_on_its_blocks(stack):
    """A tool_use input holding an integer past 64 bits (an amount in wei,
    say), which Python's json keeps and vLLM renders digit for digit: the
    Anthropic request finds the blocks of the chat request vLLM makes of it
    (`arguments` its json.dumps). The conversion was built on jansson, which
    refuses such integers, and the router routed that conversation by load
    at every later turn. (kvworker itself parses bodies with jansson and
    refuses this one, 400: the decision is what is checked here.)"""
    ng, (a, b) = setup(stack)
    call = {"policy": "4411", "limit": 123456789012345678901234567890}
    tools = TOOLS[:2]
    chat = {"model": "kvroute-mock", "max_tokens": 2, "tools": tools,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Pay out policy 4411."},
                         {"role": "assistant", "tool_calls": [{
                             "id": "toolu_01", "type": "function", "function": {
                                 "name": "lookup_policy_0", "arguments": json.dumps(call)}}]},
                         {"role": "tool", "tool_call_id": "toolu_01", "content": "Paid."}]}
    s, _, body, _ = kvt.post_json(a, "/v1/chat/completions", chat)
    assert s == 200, body
    first = body["usage"]["prompt_tokens"]
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= first // 16,
                   what="the chat form indexed")
    messages = [{"role": "user", "content": "Pay out policy 4411."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01",
                                                   "name": "lookup_policy_0", "input": call}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                              "content": "Paid."},
                                             {"type": "text", "text": "Thanks. Anything else?"}]}]
    anthropic_tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                        "input_schema": t["function"]["parameters"]} for t in tools]
    s, h, body, _ = kvt.post_json(ng.port, "/v1/messages", {
        "model": "kvroute-mock", "max_tokens": 2, "system": SYSTEM, "tools": anthropic_tools,
        "messages": messages})
    assert h.get("x-kvroute-fallback", "") == "", body
    assert h["x-kvroute-worker"] == "127.0.0.1:%d" % a
    assert int(h["x-kvroute-overlap"]) >= first // 16 - 1


def test_agent_turns_with_tools_found_by_router(stack):
    """Tools render after the system prompt and calls' arguments are parsed
    (as vLLM does) on both sides, so an agent's next turn finds every block
    of the last one."""
    agent_turns_found(stack)


def test_agent_turns_behind_sglang(stack):
    """The same behind engines that render as SGLang does (tools as bare
    functions, parts joined with spaces): chat_engine=sglang."""
    agent_turns_found(stack, extra="chat_engine=sglang", worker_extra=("--chat-engine", "sglang"))


def test_default_template_kwargs_on_both_sides(stack):
    """An operator's default chat_template_kwargs (vLLM's
    --default-chat-template-kwargs): SmolLM3 writes enable_thinking into its
    system header, so the router must render with the engines' defaults."""
    kw = '{"enable_thinking": false}'
    ng, (a, b) = setup(stack, extra="'chat_template_kwargs=%s'" % kw,
                       worker_extra=("--default-chat-template-kwargs", kw),
                       tok=os.path.join(kvt.TOP, "conf", "tokenizers", "smollm3-3b"))
    s, _, body, _ = kvt.post_json(a, "/v1/chat/completions", chat_body("First question?"))
    assert s == 200, body
    first = body["usage"]["prompt_tokens"]
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= first // 16, what="indexed")
    s, h, body, _ = kvt.post_json(ng.port, "/v1/chat/completions", chat_body("Second question?"))
    assert s == 200, body
    assert h["x-kvroute-worker"] == "127.0.0.1:%d" % a
    assert int(h["x-kvroute-overlap"]) >= (first - 20) // 16


def test_text_prompt_prefix_found_by_router(stack):
    ng, (a, b) = setup(stack)
    doc = "Clause %d: the insured shall notify the insurer within thirty days. " * 1
    text = "".join(doc % i for i in range(60))
    s, _, body, _ = kvt.post_json(b, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert s == 200
    n = body["usage"]["prompt_tokens"]
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % b) >= n // 16, what="indexed")
    s, h, body, _ = kvt.post_json(ng.port, "/v1/completions",
                                  {"prompt": text + " Summarise.", "max_tokens": 1})
    assert h["x-kvroute-worker"] == "127.0.0.1:%d" % b
    assert int(h["x-kvroute-overlap"]) >= n // 16 - 1


def test_large_prompt_goes_to_thread_pool_without_stalling_others(stack):
    ng, (a, b) = setup(stack, threshold="32k")
    big = "word%d and more text, " % 7 * 30000            # 630 KB, 180k tokens: ms of work
    def big_req():
        return kvt.post_json(ng.port, "/v1/completions", {"prompt": big, "max_tokens": 1},
                             timeout=60)
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(big_req) for _ in range(3)]
        # small requests meanwhile are served (their latency is a benchmark
        # figure, not asserted here)
        for i in range(10):
            s, h, _, _ = kvt.post_json(ng.port, "/v1/completions",
                                       {"prompt": [1, 2, 3, i], "max_tokens": 1})
            assert s == 200
        for f in futs:
            s, h, body, _ = f.result()
            assert s == 200
    s, _, body = kvt.request(ng.port, "GET", "/kvroute/status")
    assert json.loads(body)["zones"]["kv"]["threaded"] >= 3
    assert ng.alerts() == []


def test_prompt_past_max_tokenize_routes_on_its_prefix(stack):
    """max_tokenize=16k: a 48 KB prompt is routed on the blocks of its first
    16 KB (the worker that cached the whole text wins), its other tokens are
    estimated, the request is counted as prompt_capped, and it is served."""
    ng, (a, b) = setup(stack, extra="max_tokenize=16k")
    with open(os.path.join(kvt.TOP, "t", "data", "prose_en.txt"), encoding="utf-8") as f:
        text = f.read(48000)
    s, _, body, _ = kvt.post_json(b, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert s == 200
    real = body["usage"]["prompt_tokens"]
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % b) >= real // 16 - 1,
                   what="indexed")
    # the index is trusted only while the worker is live (a busy machine may
    # hold it resyncing for a while): wait for that, as routing does
    def trusted():
        s, _, body = kvt.request(ng.port, "GET", "/kvroute/status")
        ws = json.loads(body)["zones"]["kv"]["events"]["workers"]
        return (len([x for x in ws if x["state"] == "live"]) == 2
                and indexed(ng.port, "127.0.0.1:%d" % b) >= real // 16 - 1)
    kvt.wait_until(trusted, what="worker live with the text indexed")
    s, h, body, _ = kvt.post_json(ng.port, "/v1/completions",
                                  {"prompt": text + " Summarise.", "max_tokens": 1})
    assert s == 200 and body["usage"]["completion_tokens"] == 1
    assert h["x-kvroute-fallback"] == "prompt_capped"
    assert h["x-kvroute-worker"] == "127.0.0.1:%d" % b
    # ~16 KB of prose is ~3.5k tokens: its blocks (less a margin at the cut)
    assert 150 <= int(h["x-kvroute-overlap"]) < real // 16
    est = int(h["x-kvroute-prompt-tokens"])
    assert 0.9 * real <= est <= 1.1 * real, (est, real)
    st = json.loads(kvt.request(ng.port, "GET", "/kvroute/status")[2])
    assert st["zones"]["kv"]["fallbacks"]["prompt_capped"] == 1
    # under the cap: no fallback
    s, h, _, _ = kvt.post_json(ng.port, "/v1/completions",
                               {"prompt": text[:1000], "max_tokens": 1})
    assert s == 200 and h.get("x-kvroute-fallback", "") == ""    # empty: no header
    assert ng.alerts() == []
