#!/usr/bin/env python3
"""Runs every test and ends with one line: N passed, N failed[, N skipped].

C unit tests (build/t/test_*) print "ok NAME" / "not ok NAME" per test; a
binary that crashes or exits non-zero without a "not ok" line counts as one
failure. Integration tests are pytest files in t/integration.
"""
import argparse
import glob
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_unit(build, sanitize):
    passed = failed = 0
    env = dict(os.environ)
    if sanitize:
        env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0"
        env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    for path in sorted(glob.glob(os.path.join(build, "t", "test_*"))):
        name = os.path.basename(path)
        t0 = time.time()
        try:
            r = subprocess.run([path], cwd=TOP, capture_output=True, text=True, env=env,
                               timeout=600)
            out, err, rc = r.stdout, r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            out, err, rc = (e.stdout or b"").decode(), "timed out after 600 s", -1
        p = sum(1 for l in out.splitlines() if l.startswith("ok "))
        f = sum(1 for l in out.splitlines() if l.startswith("not ok "))
        if rc != 0 and f == 0:
            f = 1
        passed += p
        failed += f
        status = "ok" if f == 0 else "FAILED"
        print("unit %-28s %3d passed %3d failed  %5.1fs  %s" % (name, p, f, time.time() - t0,
                                                               status), flush=True)
        if f:
            for l in out.splitlines():
                if l.startswith("not ok"):
                    print("    " + l)
            sys.stdout.write("".join("    " + l + "\n" for l in err.splitlines()[-40:]))
    return passed, failed


def run_integration(build, sanitize, selection):
    xml = os.path.join(build, "pytest.xml")
    env = dict(os.environ, KVROUTE_BUILD=os.path.abspath(build),
               KVROUTE_SANITIZE="1" if sanitize else "0", PYTHONDONTWRITEBYTECODE="1")
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
            "--junitxml", xml, "-o", "junit_family=xunit1"] + (selection or ["t/integration"])
    rc = subprocess.run(args, cwd=TOP, env=env).returncode
    if not os.path.exists(xml):
        return 0, 1, 0
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = sum(int(s.get("tests", 0)) for s in suites)
    fails = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skips = sum(int(s.get("skipped", 0)) for s in suites)
    if rc not in (0, 1, 5) and fails == 0:
        fails = 1     # pytest itself broke (usage error, internal error)
    return total - fails - skips, fails, skips


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--sanitize", default="0")
    ap.add_argument("--unit-only", action="store_true")
    ap.add_argument("select", nargs="*", help="pytest selection (default: t/integration)")
    a = ap.parse_args()
    sanitize = a.sanitize == "1"
    t0 = time.time()
    p1, f1 = (0, 0) if a.select else run_unit(a.build, sanitize)
    p2 = f2 = s2 = 0
    if not a.unit_only:
        p2, f2, s2 = run_integration(a.build, sanitize, a.select)
    print("\nunit: %d passed, %d failed; integration: %d passed, %d failed, %d skipped; %.0fs"
          % (p1, f1, p2, f2, s2, time.time() - t0))
    line = "%d passed, %d failed" % (p1 + p2, f1 + f2)
    if s2:
        line += ", %d skipped" % s2
    print(line)
    return 1 if f1 + f2 else 0


if __name__ == "__main__":
    sys.exit(main())
