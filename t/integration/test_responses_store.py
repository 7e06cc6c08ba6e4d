"""kvworker --responses-store: a Responses API response kept by the engine
that made it, continued with previous_response_id and fetched with GET
/v1/responses/{id}, as vLLM does with its store turned on; with the store
off (the default, as vLLM's) or the response not kept, 404. Through the
official `openai` client against a real kvworker."""
import os
import subprocess

import openai
import pytest

import kvt

MODEL = "kvroute-mock"


def client(port):
    return openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % port, api_key="none",
                         max_retries=0, timeout=30)


def test_a_continuation_is_the_whole_conversation(stack):
    """Three turns: each continuation's prompt is this turn's instructions,
    every earlier input and output, and the new input (the same prompt
    tokens as that chat request), its history found in the prefix cache;
    the Response is kept as it was sent, streamed or not."""
    c = client(stack.worker(extra=["--responses-store", "8", "--speedup", "50"]).ports[0])
    r1 = c.responses.create(model=MODEL, instructions="Be brief.", input="hello there",
                            max_output_tokens=5)
    r2 = c.responses.create(model=MODEL, instructions="Be brief.", previous_response_id=r1.id,
                            input=[{"role": "user", "content": "and then?"}],
                            max_output_tokens=4)
    # a previous response's instructions are not carried over (OpenAI's rule):
    # one system message, this turn's
    chat = c.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "and then?"}])
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    assert r2.usage.input_tokens_details.cached_tokens > 0
    events = list(c.responses.create(model=MODEL, previous_response_id=r2.id, input="more",
                                     max_output_tokens=3, stream=True))
    r3 = events[-1].response
    assert events[-1].type == "response.completed"
    assert r3.usage.input_tokens > r2.usage.input_tokens + r2.usage.output_tokens
    for r in (r1, r2, r3):
        got = c.responses.retrieve(r.id)
        assert (got.id, got.output_text, got.usage.input_tokens) == \
            (r.id, r.output_text, r.usage.input_tokens)


def test_unknown_evicted_unstored_and_store_off_are_404(stack):
    """What the engine does not hold is a 404 naming the id, before any
    work: an id it never made, one pushed out by newer responses, one sent
    with "store": false, any id when the store is off."""
    port = stack.worker(extra=["--responses-store", "2", "--speedup", "50"]).ports[0]
    c = client(port)
    old = c.responses.create(model=MODEL, input="first", max_output_tokens=1)
    unkept = c.responses.create(model=MODEL, input="x", max_output_tokens=1, store=False)
    for i in range(2):
        c.responses.create(model=MODEL, input="push %d" % i, max_output_tokens=1)
    for rid in ("resp-nope", old.id, unkept.id):
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.create(model=MODEL, input="next", previous_response_id=rid,
                               max_output_tokens=1)
        err = e.value.response.json()["error"]
        assert rid in err["message"] and "not found" in err["message"], err
        assert (err["param"], err["code"]) == ("previous_response_id",
                                               "previous_response_not_found")
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(rid)
    s, _, body, _ = kvt.post_json(port, "/v1/responses", {
        "model": MODEL, "input": "x", "previous_response_id": 12})
    assert s == 400 and body["error"]["param"] == "previous_response_id", body
    off = client(stack.worker(extra=["--speedup", "50"]).ports[0])
    r = off.responses.create(model=MODEL, input="x", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        off.responses.create(model=MODEL, input="y", previous_response_id=r.id,
                             max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        off.responses.retrieve(r.id)


def test_bad_option_is_refused():
    r = subprocess.run([os.path.join(kvt.BIN, "kvworker"), "--engine", "mock",
                        "--responses-store", "-1"], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "numeric options" in r.stderr, r.stderr
