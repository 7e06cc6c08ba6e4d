"""Turn-delta tokenization: decision time of multi-turn chats, turn cache on
vs off in the same run (docs/BENCHMARKS.md, "Turn-delta tokenization").

One nginx (NGINX_WORKERS worker processes, default 2) fronts a trivial
upstream nginx through two kvroute upstreams that differ only in their
zone's turn_cache (default size vs 0), with the Qwen2.5 tokenizer and chat
template. CONVS conversations of TURNS turns each: turn 1 is a ~8.7k-token
system prompt of English prose plus a question; each later turn adds the
previous answer (~150 tokens) and a new question (~100 tokens), as chat
clients resend the whole history. Every request is sent to both upstreams
back to back (on, off, alternating which goes first), one connection, so
both see the same machine state; $kvroute_decision_us comes from the access
log. KIND=chat (messages) or completion (the same turns as ChatML text).
"""
import http.client
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "t", "lib"))
import kvt  # noqa: E402

CONVS = int(os.environ.get("CONVS", "30"))
TURNS = int(os.environ.get("TURNS", "10"))
KIND = os.environ.get("KIND", "chat")
WORKERS = int(os.environ.get("NGINX_WORKERS", "2"))
SIDES = os.environ.get("SIDES", "on,off").split(",")     # SIDES=on: for a profile
QWEN = os.path.join(kvt.TOP, "conf", "tokenizers", "qwen2.5-instruct")

REPLY = ('{"id":"c","object":"chat.completion","choices":[{"index":0,"message":'
         '{"role":"assistant","content":"x"},"finish_reason":"length"}],"usage":'
         '{"prompt_tokens":64,"completion_tokens":1,"total_tokens":65}}')

FRONT = """
    kvroute_zone on 64m;
    kvroute_zone off 64m turn_cache=0;
    upstream on { zone on_up 64k; kvroute zone=on tokenizer=%(q)s/tokenizer.json
                  chat_template=%(q)s/tokenizer_config.json; %(servers)s keepalive 8; }
    upstream off { zone off_up 64k; kvroute zone=off tokenizer=%(q)s/tokenizer.json
                   chat_template=%(q)s/tokenizer_config.json; %(servers)s keepalive 8; }
    log_format dec '$kvroute_decision_us $kvroute_prompt_tokens $kvroute_turn_cached_tokens '
                   '$http_x_turn $pid';
    server {
        listen 127.0.0.1:%%(port)s;
        client_body_buffer_size 1m;
        location /on/ { access_log %(dir)s/on.log dec; kvroute_upstream on; proxy_pass http://on/;
                        proxy_http_version 1.1; proxy_set_header Connection ""; }
        location /off/ { access_log %(dir)s/off.log dec; kvroute_upstream off; proxy_pass http://off/;
                         proxy_http_version 1.1; proxy_set_header Connection ""; }
        location = /kvroute/status { kvroute_status; }
    }
"""


def conversations(prose):
    """CONVS lists of TURNS message lists (each turn's full history)."""
    out = []
    for c in range(CONVS):
        base = (c * 7919) % (len(prose) - 200000)
        system = prose[base:base + 37000]           # ~8.6k tokens
        pos = base + 40000
        msgs = [{"role": "system", "content": system}]
        turns = []
        for t in range(TURNS):
            q = prose[pos:pos + 420]
            pos += 420
            msgs = msgs + [{"role": "user", "content": q}]
            turns.append(msgs)
            a = prose[pos:pos + 640]
            pos += 640
            msgs = msgs + [{"role": "assistant", "content": a}]
        out.append(turns)
    return out


def chatml(msgs):
    return "".join("<|im_start|>%s\n%s<|im_end|>\n" % (m["role"], m["content"]) for m in msgs) \
        + "<|im_start|>assistant\n"


def body(msgs):
    if KIND == "chat":
        return "/v1/chat/completions", {"model": "m", "max_tokens": 1, "messages": msgs}
    return "/v1/completions", {"model": "m", "max_tokens": 1, "prompt": chatml(msgs)}


def pct(xs, p):
    """None for no samples (TURNS=1 has no follow-up turns)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None


def main():
    build = os.environ.get("KVROUTE_BUILD")
    if build:
        kvt.BUILD = build
    prose = open(os.path.join(kvt.TOP, "t", "data", "prose_en.txt"), encoding="utf-8").read()
    convs = conversations(prose)
    st = kvt.Stack("bench-turns")
    try:
        up = kvt.free_port()
        st.nginx(kvt.canned_servers([up], REPLY), workers=1, port=up)
        front = st.nginx(FRONT % {"q": QWEN, "servers": "server 127.0.0.1:%d;" % up,
                                  "dir": st.dir}, workers=WORKERS)
        conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
        # warm both sides (each nginx worker's first request pays for cold
        # caches): a few requests not counted (X-Turn 0)
        for k in range(4 * WORKERS):
            path, obj = body([{"role": "user", "content": prose[k * 5000:k * 5000 + 4000]}])
            for side in SIDES:
                c = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
                c.request("POST", "/%s%s" % (side, path), json.dumps(obj),
                          {"Content-Type": "application/json", "X-Turn": "0"})
                c.getresponse().read()
                c.close()
        n = 0
        for turns in convs:
            for t, msgs in enumerate(turns):
                path, obj = body(msgs)
                data = json.dumps(obj)
                order = SIDES if n % 2 == 0 else SIDES[::-1]
                n += 1
                for side in order:
                    conn.request("POST", "/%s%s" % (side, path), data,
                                 {"Content-Type": "application/json", "X-Turn": str(t + 1)})
                    r = conn.getresponse()
                    r.read()
                    assert r.status == 200, r.status
        conn.close()
        time.sleep(0.5)     # the access log is written after the response
        res = {}
        for side in SIDES:
            rows = [l.split() for l in open(os.path.join(st.dir, side + ".log"))]
            rows = [r for r in rows if r[3] != "0"]
            first = [int(r[0]) for r in rows if r[3] == "1"]
            follow = [int(r[0]) for r in rows if r[3] != "1"]
            ftok = [int(r[1]) for r in rows if r[3] == "1"]
            cached = [int(r[2]) for r in rows if r[3] != "1"]
            res[side] = {"first_p50_us": pct(first, .5), "first_p90_us": pct(first, .9),
                         "first_p99_us": pct(first, .99),
                         "follow_p50_us": pct(follow, .5), "follow_p99_us": pct(follow, .99),
                         "first_tokens_p50": pct(ftok, .5), "n_first": len(first),
                         "n_follow": len(follow),
                         "follow_cached_tokens_p50": pct(cached, .5),
                         "follow_tokens_max": max(int(r[1]) for r in rows),
                         "first_top3_us": sorted(first)[-3:], "follow_top3_us": sorted(follow)[-3:]}
        if len(SIDES) == 2:
            res["ratio_follow_p50"] = round(res["on"]["follow_p50_us"] / res["off"]["follow_p50_us"],
                                            3)
            res["ratio_follow_p99"] = round(res["on"]["follow_p99_us"] / res["off"]["follow_p99_us"],
                                            3)
        res["kind"] = KIND
        res["loadavg"] = open("/proc/loadavg").read().split()[:3]
        print(json.dumps(res))
    finally:
        st.close()


if __name__ == "__main__":
    main()
