#!/usr/bin/env python3
"""Generates src/core/kv_unicode_tables.c: the character classes of the
tokenizers' pre-tokenizer regexes and what NFC must leave alone, at the
Unicode versions Hugging Face `tokenizers` (0.23.3) uses.

- kv_uni_letters, kv_uni_numbers: general categories L* and N* (\\p{L},
  \\p{N}) of Unicode 16.0.0, the tables of the Oniguruma HF's regexes run on
  (measured: HF's \\p{L} and \\p{N} equal 16.0's for every code point, and
  differ from 15.0, 15.1 and 17.0). Taken from the PyPI package
  `unicodedata2` 16.0.0.
- kv_uni_spaces: the White_Space property (\\s), from PropList.txt in UCD
  (Debian's 15.0; White_Space has not changed since Unicode 6.3, and the
  generator checks it against 16.0's categories).
- kv_uni_nfc_new: code points HF's NFC does not know. HF normalizes with
  Unicode 9.0 data (crate unicode-normalization-alignments); libutf8proc is
  newer (Debian 12: 15.0). A code point assigned after 9.0 that has a
  canonical combining class, a canonical decomposition, or is part of one
  (as of 16.0) is normalized differently by the two; to HF it is an
  unassigned starter that composes with nothing, so kvroute normalizes the
  text on either side of it apart (kv_uni_nfc in kv_unicode.c). Ages come
  from DerivedAge.txt in UCD; a code point it does not list is newer.

Regenerate (no PyPI at build time: the output is committed):

    python3 -m venv /tmp/ucd && /tmp/ucd/bin/pip install unicodedata2==16.0.0
    /tmp/ucd/bin/python tools/gen-unicode-tables.py > src/core/kv_unicode_tables.c

UCD=DIR points at another Unicode Character Database (default
/usr/share/unicode, Debian package unicode-data).

`fixtures` writes t/data/tokenizer/unicode.jsonl instead, for
t/unit/test_tokenizer.c: what HF tokenizers makes of the code points whose
class differs between the UCD in UCD (Debian 12's 15.0: the tables kvroute
had) and 16.0, and of the NFC-new ones, a few per range, in a few contexts,
for every shipped tokenizer. It needs HF tokenizers in the same venv:

    /tmp/ucd/bin/pip install tokenizers==0.23.3
    /tmp/ucd/bin/python tools/gen-unicode-tables.py fixtures > t/data/tokenizer/unicode.jsonl
"""
import json
import os
import sys

import unicodedata2

UCD = os.environ.get("UCD", "/usr/share/unicode")
CLASS_VERSION = "16.0.0"    # HF's Oniguruma \p{L} \p{N}
NFC_VERSION = (9, 0)        # HF's NFC (unicode-normalization-alignments)
ALL = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]


def ucd_lines(name):
    for line in open(os.path.join(UCD, name), encoding="utf-8"):
        line = line.split("#")[0].strip()
        if line:
            yield [x.strip() for x in line.split(";")]


def cp_range(field):
    lo, _, hi = field.partition("..")
    return range(int(lo, 16), int(hi or lo, 16) + 1)


def white_space():
    out = set()
    for rng, prop in ucd_lines("PropList.txt"):
        if prop == "White_Space":
            out.update(cp_range(rng))
    # the property is stable; this says it still is at CLASS_VERSION
    derived = {c for c in ALL if unicodedata2.category(chr(c)) in ("Zs", "Zl", "Zp")}
    if out != derived | {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x85}:
        sys.exit("White_Space in %s differs from Unicode %s's separators" % (UCD, CLASS_VERSION))
    return out


def assigned_by(version):
    out = set()
    for rng, age in ucd_lines("DerivedAge.txt"):
        if tuple(int(x) for x in age.split(".")) <= version:
            out.update(cp_range(rng))
    return out


def canonical(c):
    d = unicodedata2.decomposition(chr(c))
    return [] if not d or d.startswith("<") else [int(x, 16) for x in d.split()]


def nfc_new():
    """Assigned after NFC_VERSION and taking part in normalization."""
    old = assigned_by(NFC_VERSION)
    parts = set()
    for c in ALL:
        parts.update(canonical(c))
    return {c for c in ALL if c not in old and unicodedata2.category(chr(c)) != "Cn"
            and (unicodedata2.combining(chr(c)) or canonical(c) or c in parts)}


def ranges(cps):
    out = []
    for c in sorted(cps):
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return out


def emit(name, rs):
    print("const kv_uni_range_t %s[] = {" % name)
    for i in range(0, len(rs), 4):
        print("    " + " ".join("{0x%05X, 0x%05X}," % (lo, hi) for lo, hi in rs[i:i + 4]))
    print("};")
    print("const unsigned %s_n = %d;\n" % (name, len(rs)))


def ucd_classes():
    """Letter, number, space or other by the UCD in UCD."""
    cats, first = {}, None
    for f in ucd_lines("UnicodeData.txt"):
        cp, name, cat = int(f[0], 16), f[1], f[2]
        if name.endswith(", First>"):
            first = cp
            continue
        for c in range(first if name.endswith(", Last>") else cp, cp + 1):
            cats[c] = cat
    return cats


def cls(cat, c, spaces):
    return "S" if c in spaces else cat[:1] if cat[:1] in "LN" else "O"


def sample(rs, per_range=6):
    """The ends of each range and a few code points evenly inside."""
    out = []
    for lo, hi in rs:
        step = max(1, (hi - lo) // (per_range - 1))
        out += sorted(set(range(lo, hi + 1, step)) | {hi})
    return out


CONTEXTS = [lambda c: c, lambda c: " " + c + "1", lambda c: "a" + c]
NFC_CONTEXTS = [lambda c: "a" + c + "\u0334", lambda c: "e" + c + "\u0301"]


def fixtures():
    from tokenizers import Tokenizer

    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    old, spaces = ucd_classes(), white_space()
    moved = [c for c in ALL if cls(old.get(c, "Cn"), c, spaces)
             != cls(unicodedata2.category(chr(c)), c, spaces)]
    for name in ["gpt2", "phi-3-mini-4k-instruct", "qwen2.5-instruct", "smollm3-3b"]:
        tok = Tokenizer.from_file(os.path.join(top, "conf", "tokenizers", name, "tokenizer.json"))
        texts = [f(chr(c)) for c in sample(ranges(moved)) for f in CONTEXTS]
        texts += [f(chr(c)) for c in sample(ranges(nfc_new()), 3) for f in NFC_CONTEXTS]
        for text in texts:
            print(json.dumps({"model": name, "text": text, "ids": tok.encode(text).ids}))


def main():
    if unicodedata2.unidata_version != CLASS_VERSION:
        sys.exit("want unicodedata2 %s, have %s" % (CLASS_VERSION, unicodedata2.unidata_version))
    if sys.argv[1:] == ["fixtures"]:
        fixtures()
        return
    cats = {c: unicodedata2.category(chr(c)) for c in ALL}
    print("/* Generated by tools/gen-unicode-tables.py (see there how): classes of")
    print(" * Unicode %s (unicodedata2), White_Space and ages from the UCD in" % CLASS_VERSION)
    print(" * %s; do not edit. */" % UCD)
    print('#include "kv_unicode.h"\n')
    emit("kv_uni_letters", ranges(c for c, k in cats.items() if k.startswith("L")))
    emit("kv_uni_numbers", ranges(c for c, k in cats.items() if k.startswith("N")))
    emit("kv_uni_spaces", ranges(white_space()))
    new = nfc_new()
    if min(new) < 0x7C0:    # kv_tokenizer.c skips every byte below 0xdf, the lead of U+07C0
        sys.exit("an NFC-new code point below U+07C0: U+%04X" % min(new))
    emit("kv_uni_nfc_new", ranges(new))


if __name__ == "__main__":
    main()
