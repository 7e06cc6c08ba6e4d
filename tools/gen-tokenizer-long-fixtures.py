#!/usr/bin/env python3
"""Writes t/data/tokenizer/long_words.json: what HF `tokenizers` makes of
long single words (hundreds of KB with no space: the long-word merge path of
src/text/kv_tok_bpe.c), for every tokenizer of the test suite. The strings
are not stored: both this script and t/unit/test_tokenizer.c make them with
the same generator (a 64-bit LCG picking from an alphabet), and the file
holds, per case and model, the id count and an FNV-1a hash of the ids (as
32-bit little-endian). Rerun: .venv/bin/python tools/gen-tokenizer-long-fixtures.py
"""
import json
import os
import struct

from tokenizers import Tokenizer

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ["gpt2", "phi-3-mini-4k-instruct", "qwen2.5-instruct", "smollm3-3b"]
M64 = (1 << 64) - 1

# name, length, alphabet, seed ("" alphabet: the old scaling test's pattern)
CASES = [
    ("random_lowercase", 300000, "abcdefghijklmnopqrstuvwxyz", 1),
    ("random_ab", 100000, "ab", 2),
    ("same_letter", 60000, "a", 3),
    ("pattern10", 200000, "", 0),
    ("words_and_spaces", 200000, "abcde ", 4),
]


def text(length, alphabet, seed):
    if not alphabet:
        return "".join("abcdefghij"[(i * 7 + i // 13) % 10] for i in range(length))
    x, out = seed, []
    for _ in range(length):
        x = (x * 6364136223846793005 + 1442695040888963407) & M64
        out.append(alphabet[(x >> 33) % len(alphabet)])
    return "".join(out)


def fnv(ids):
    h = 0xcbf29ce484222325
    for b in struct.pack("<%dI" % len(ids), *ids):
        h = ((h ^ b) * 0x100000001b3) & M64
    return h


def main():
    out = {"cases": []}
    toks = {m: Tokenizer.from_file(os.path.join(TOP, "conf/tokenizers", m, "tokenizer.json"))
            for m in MODELS}
    for name, length, alphabet, seed in CASES:
        s = text(length, alphabet, seed)
        want = {}
        for m in MODELS:
            ids = toks[m].encode(s, add_special_tokens=False).ids
            want[m] = {"n": len(ids), "fnv": "%016x" % fnv(ids)}
        out["cases"].append({"name": name, "length": length, "alphabet": alphabet,
                             "seed": seed, "want": want})
        print(name, json.dumps(want))
    with open(os.path.join(TOP, "t/data/tokenizer/long_words.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
