"""kvtok, the command-line face of src/text's tokenizer, templates and hashing,
checked against HF tokenizers and the jinja2-rendered chat fixtures."""
import json
import os
import subprocess

import pytest
from tokenizers import Tokenizer

import kvt

KVTOK = os.path.join(kvt.BIN, "kvtok")
TOK = os.path.join(kvt.TOP, "conf", "tokenizers")


def run(args, stdin):
    env = dict(kvt.sanitizer_env(), KV_CHAT_NOW="1721995200")
    return subprocess.run([KVTOK] + args, input=stdin.encode() if isinstance(stdin, str) else stdin,
                          capture_output=True, env=env, cwd=kvt.TOP)


@pytest.mark.parametrize("model", ["gpt2", "qwen2.5-instruct", "smollm3-3b",
                                   "phi-3-mini-4k-instruct"])
def test_jsonl_encode_equals_hf(model):
    path = os.path.join(TOK, model, "tokenizer.json")
    hf = Tokenizer.from_file(path)
    texts = ["Hello world", "  two  spaces", "naïve café 123456", "<|endoftext|>x", "日本語", "",
             "a\u0000b c\u0000"]
    r = run(["encode", "--tokenizer", path, "--jsonl"], "\n".join(json.dumps(t) for t in texts))
    assert r.returncode == 0, r.stderr
    got = [json.loads(l) for l in r.stdout.decode().splitlines()]
    assert got == [hf.encode(t).ids for t in texts]
    r = run(["encode", "--tokenizer", path, "--no-special"], "Hello world")
    assert json.loads(r.stdout) == hf.encode("Hello world", add_special_tokens=False).ids


@pytest.mark.parametrize("model", ["qwen2.5-instruct", "smollm3-3b", "phi-3-mini-4k-instruct"])
def test_chat_encode_equals_rendered_template(model):
    """--chat renders with the model's template and encodes without adding
    specials, as transformers' apply_chat_template(tokenize=True) does."""
    path = os.path.join(TOK, model, "tokenizer.json")
    hf = Tokenizer.from_file(path)
    cases = [json.loads(l) for l in open(os.path.join(kvt.TOP, "t", "data", "chat",
                                                       model + ".jsonl"))]
    cases = [c for c in cases if c["add_generation_prompt"] and "output" in c and not c["tools"]
             and not c.get("kwargs")]
    assert len(cases) >= 5
    lines = "\n".join(json.dumps(c["messages"]) for c in cases)
    r = run(["encode", "--tokenizer", path, "--chat", "--jsonl"], lines)
    got = [json.loads(l) for l in r.stdout.decode().splitlines()]
    want = [hf.encode(c["output"], add_special_tokens=False).ids for c in cases]
    assert len(got) == len(want)
    assert got == want


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_chat_request_encode_equals_the_engines_render(engine):
    """--chat takes a whole request (tools and all) and renders it by the
    engine's rules: the ids of t/data/chat/requests.jsonl's expected text."""
    path = os.path.join(TOK, "qwen2.5-instruct", "tokenizer.json")
    hf = Tokenizer.from_file(path)
    cases = [json.loads(l) for l in open(os.path.join(kvt.TOP, "t", "data", "chat",
                                                       "requests.jsonl"))]
    cases = [c for c in cases if c["template"] == "qwen2.5-instruct" and c["engine"] == engine
             and "output" in c and '"add_special_tokens"' not in c["body"]]
    assert len(cases) >= 15
    r = run(["encode", "--tokenizer", path, "--chat", "--chat-engine", engine, "--jsonl"],
            "\n".join(c["body"] for c in cases))
    assert r.returncode == 0, r.stderr
    got = [json.loads(l) for l in r.stdout.decode().splitlines()]
    assert got == [hf.encode(c["output"], add_special_tokens=False).ids for c in cases]


def test_hash_vectors():
    r = run(["hash", "--block-size", "4"], "[11,22,33,44,55,66,77,88,99]")
    assert r.stdout.decode().split() == ["4117275816416024698", "5947898228081096063"]
    r = run(["hash", "--block-size", "4", "--salt", "tenant"], "[11,22,33,44]")
    assert r.stdout.decode().split() != ["4117275816416024698"]


def test_decode_round_trip():
    path = os.path.join(TOK, "qwen2.5-instruct", "tokenizer.json")
    r = run(["encode", "--tokenizer", path], "Grüße, 世界! 🍕")
    r2 = run(["decode", "--tokenizer", path], r.stdout)
    assert r2.stdout.decode() == "Grüße, 世界! 🍕"


def test_bad_input_is_reported():
    path = os.path.join(TOK, "gpt2", "tokenizer.json")
    r = run(["encode", "--tokenizer", path, "--jsonl"], '"ok"\n{"not": "a string"}\n"fine"\n')
    assert r.returncode == 1 and b"line 2" in r.stderr
    assert len(r.stdout.decode().splitlines()) == 2
    r = run(["decode", "--tokenizer", path], "[1, -5]")
    assert r.returncode == 1
    r = run(["encode", "--tokenizer", "/nonexistent.json"], "x")
    assert r.returncode == 1 and b"cannot open" in r.stderr
