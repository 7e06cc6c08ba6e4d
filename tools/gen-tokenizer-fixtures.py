#!/usr/bin/env python3
"""Writes t/data/tokenizer/<model>.jsonl: what HF `tokenizers` makes of a
fixed corpus of strings, for every tokenizer in conf/tokenizers/. Rerun it
(.venv/bin/python tools/gen-tokenizer-fixtures.py) after changing the corpus
or a tokenizer; t/unit/test_tokenizer.c checks kvroute against the files.

Each line: {"text": str} or {"hex": bytes-as-hex} for invalid UTF-8 (HF sees
bytes.decode("utf-8", "replace"), as a Python service would), plus "ids"
(encode with special tokens), "ids_nospecial" and "decoded" (decode(ids,
skip_special_tokens=False)). The corpus is built deterministically here.
"""
import json
import os
import random

from tokenizers import Tokenizer

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "Call me Ishmael. Some years ago - never mind how long precisely - having little money.",
    "In a hole in the ground there lived a hobbit.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "Mr. and Mrs. Dursley, of number four, Privet Drive, were proud to say that they were perfectly normal.",
    "She said: \"I'll be there at 5:30pm, don't wait!\" and left.",
    "Hello, world! How are you doing today? I'm fine, thanks.",
    "The U.S.A. has 50 states; e.g. Texas, Ohio, etc.",
    "Prices rose 3.5% in Q3 2024 to $1,234,567.89 (a record).",
]
SCRIPTS = [
    "Привет, как дела? Я изучаю русский язык.",
    "Καλημέρα κόσμε, τι κάνεις;",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "שלום עולם, מה שלומך?",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "สวัสดีชาวโลก คุณเป็นอย่างไรบ้าง",
    "你好，世界！今天天气很好。我们去公园吧。",
    "日本語のテキストです。カタカナとひらがなと漢字。",
    "안녕하세요 세계! 오늘 날씨가 좋네요.",
    "Tiếng Việt có dấu: Xin chào thế giới.",
    "Zürich, Köln, Straße, Ærøskøbing, Ångström, façade, naïve, jalapeño.",
    "Türkçe: İstanbul'da ılık bir gün.",
    "ქართული ენა, Հայերեն լեզու, ᏣᎳᎩ",
    "Ελληνικά ΚΕΦΑΛΑΙΑ και μικρά",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𝒜𝒷𝒸 ℝ ℕ ℤ",
]
EMOJI = [
    "I love 🍕 and 🍣!", "👨‍👩‍👧‍👦 family", "🏳️‍🌈 flag", "👍🏽👍🏿 thumbs", "🇫🇷🇯🇵 flags",
    "❤️🔥💯", "🤖🦾 robots", "🧑🏻‍💻 coder", "smile😀😃😄😁", "keycap 1️⃣ #️⃣",
]
COMBINING = [
    "e\u0301 vs é", "a\u0300\u0301\u0302", "Z\u0351\u0352\u0353a\u0354l\u0355g\u0356o",
    "n\u0303o\u0308", "\u1100\u1161\u11a8 jamo", "Å vs A\u030a", "ﬁ ligature ﬀ", "Ⅻ roman ½ ¼ ²",
    "\u0915\u094d\u0937", "\u00a0nbsp\u00a0here", "zero\u200bwidth\u200cjoin\u200d",
]
CODE = [
    "def f(x):\n    return x * 2\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "for (i = 0; i < n; i++) { sum += a[i]; }",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "<div class=\"x\"><a href='https://example.com/?q=1&r=2'>link</a></div>",
    "x = y ** 2 // 3 % 4 != 5 && z || !w",
    "    indented\n        more\n\t\ttabs\n",
    "#!/bin/sh\nset -e\necho \"$HOME\" | grep -v '^#'\n",
    "λx. x + 1; ∀n ∈ ℕ: n ≥ 0 → √n",
]
WS = [
    "a  b", "a   b    c", "\t\t", "\n\n\n", "  \n  ", "trailing   ", "   leading", "mixed \t\n \r\n end",
    " ", "\n", "\r\n", "a\n\nb", "x \n y", "  \n\n  \t", "a\u3000b", "end\n", " \n", "\n ",
    "word\r\rword", "a \u00a0 b",
]
DIGITS = [
    "1234567890", "3.14159265358979", "1,000,000", "007", "2024-01-01T12:00:00Z",
    "v1.2.3", "0x1F2E3D", "١٢٣٤٥", "１２３", "12345678901234567890123",
]
CONTRACTIONS = [
    "I'm", "you're", "he's", "she'S", "it'D", "we'VE", "they'Re", "I'LL", "don't", "WON'T",
    "'s", "'t", "''", "rock'n'roll", "O'Neil's", "it’s curly", "can't've",
]
LONG = ["a" * 300, "antidisestablishmentarianism" * 12, "ab" * 400, "x" * 1000 + " y",
        "supercalifragilisticexpialidocious", "😀" * 100, "。" * 200, " " * 300, "\n" * 100,
        "-" * 256, "1" * 200]
INVALID = [b"\xff\xfe", b"abc\xe2\x82", b"\xc3\x28", b"ok\x80ok", b"\xf0\x9f\x98",
           b"\xed\xa0\x80 surrogate", b"\xc0\xaf overlong", b"tail\xe2", b"\xf4\x90\x80\x80 big",
           b"mixed \xc3\xa9 \xe9 latin1"]


def specials(tok):
    return [t.content for t in tok.get_added_tokens_decoder().values()][:12]


def corpus(special_tokens):
    rnd = random.Random(1337)
    frags = PROSE + SCRIPTS + EMOJI + COMBINING + CODE + WS + DIGITS + CONTRACTIONS
    out = [(s, None) for s in frags + LONG]
    out += [(None, b) for b in INVALID]
    for sp in special_tokens:
        out.append(("hello" + sp + "world", None))
        out.append((" " + sp + " x ", None))
        out.append((sp, None))
        out.append(("a\n" + sp + "\nb", None))
    while len(out) < 2100:
        k = rnd.randint(1, 4)
        parts = [rnd.choice(frags) for _ in range(k)]
        sep = rnd.choice(["", " ", "\n", "  ", "\t", ". ", "\n\n"])
        s = sep.join(parts)
        if rnd.random() < 0.1 and special_tokens:
            i = rnd.randint(0, len(s))
            s = s[:i] + rnd.choice(special_tokens) + s[i:]
        if rnd.random() < 0.05:
            b = s.encode()
            i = rnd.randint(0, len(b))
            out.append((None, b[:i] + bytes([rnd.choice([0x80, 0xbf, 0xc3, 0xe2, 0xff])]) + b[i:]))
            continue
        out.append((s, None))
    return out


def main():
    base = os.path.join(TOP, "conf", "tokenizers")
    dest = os.path.join(TOP, "t", "data", "tokenizer")
    os.makedirs(dest, exist_ok=True)
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name, "tokenizer.json")
        if not os.path.exists(path):
            continue
        try:
            tok = Tokenizer.from_file(path)
        except Exception as e:      # noqa: BLE001 - report and go on
            # HF itself cannot load it (tinyllama's legacy merges with
            # spaces inside tokens); kvroute must refuse it too
            print(name, "not loadable by HF tokenizers:", e)
            open(os.path.join(dest, name + ".refused"), "w").write(str(e) + "\n")
            continue
        rows = corpus(specials(tok))
        with open(os.path.join(dest, name + ".jsonl"), "w") as f:
            for text, raw in rows:
                s = text if raw is None else raw.decode("utf-8", "replace")
                ids = tok.encode(s).ids
                rec = {"text": text} if raw is None else {"hex": raw.hex()}
                rec["ids"] = ids
                rec["ids_nospecial"] = tok.encode(s, add_special_tokens=False).ids
                rec["decoded"] = tok.decode(ids, skip_special_tokens=False)
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        print(name, len(rows))


if __name__ == "__main__":
    main()
