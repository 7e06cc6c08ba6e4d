#!/usr/bin/env python3
"""Runs every test and ends with one line: N passed, N failed[, N skipped].

C unit tests (build/t/test_*) print "ok NAME" / "not ok NAME" per test; a
binary that crashes or exits non-zero without a "not ok" line counts as one
failure. Integration tests are pytest files in t/integration.
"""
import argparse
import glob
import json
import os
import queue
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor, as_completed

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_LINES = 300     # of a failing file's output, shown in the summary


def run_binary(path, env):
    t0 = time.time()
    try:
        r = subprocess.run([path], cwd=TOP, capture_output=True, text=True, env=env,
                           timeout=600)
        out, err, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out, err, rc = (e.stdout or b"").decode(), "timed out after 600 s", -1
    return os.path.basename(path), out, err, rc, time.time() - t0


def run_unit(build, sanitize, jobs):
    """Every unit binary, jobs at a time, reported in name order."""
    passed = failed = 0
    env = dict(os.environ)
    if sanitize:
        env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0"
        env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    paths = sorted(glob.glob(os.path.join(build, "t", "test_*")))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for name, out, err, rc, secs in pool.map(lambda p: run_binary(p, env), paths):
            p = sum(1 for l in out.splitlines() if l.startswith("ok "))
            f = sum(1 for l in out.splitlines() if l.startswith("not ok "))
            if rc != 0 and f == 0:
                f = 1
            passed += p
            failed += f
            print("unit %-28s %3d passed %3d failed  %5.1fs  %s"
                  % (name, p, f, secs, "ok" if f == 0 else "FAILED"), flush=True)
            if f:
                for l in out.splitlines():
                    if l.startswith("not ok"):
                        print("    " + l)
                sys.stdout.write("".join("    " + l + "\n" for l in err.splitlines()[-40:]))
    return passed, failed


def pytest_env(build, sanitize, port_slice=None):
    env = dict(os.environ, KVROUTE_BUILD=os.path.abspath(build),
               KVROUTE_SANITIZE="1" if sanitize else "0", PYTHONDONTWRITEBYTECODE="1")
    if port_slice:
        env["KVROUTE_TEST_SLICE"] = port_slice      # t/lib/kvt.py's free_port
    return env


def pytest_argv(xml, selection):
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
            "--junitxml", xml, "-o", "junit_family=xunit1"] + selection


def count_xml(xml, rc):
    """(passed, failed, skipped) from a junit file; pytest that broke counts
    as one failure."""
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


def run_selection(build, sanitize, selection):
    """What was asked for, in one pytest process, its output as it comes."""
    xml = os.path.join(build, "pytest.xml")
    if os.path.exists(xml):
        os.unlink(xml)
    rc = subprocess.run(pytest_argv(xml, selection), cwd=TOP,
                        env=pytest_env(build, sanitize)).returncode
    return count_xml(xml, rc)


def file_order(build, files):
    """Longest first, so that the last file to finish is a short one: by the
    last run's times (build/pytest-times.json) where there are some, else by
    size (a fresh clone: the big files are the slow ones)."""
    try:
        with open(os.path.join(build, "pytest-times.json")) as f:
            times = json.load(f)
    except (OSError, ValueError):
        times = {}
    names = [os.path.basename(f) for f in files]
    if all(isinstance(times.get(n), (int, float)) for n in names):
        return sorted(files, key=lambda f: times[os.path.basename(f)], reverse=True)
    return sorted(files, key=os.path.getsize, reverse=True)


def run_file(build, sanitize, path, outdir, slots, jobs):
    name = os.path.basename(path)[:-3]
    xml = os.path.join(outdir, name + ".xml")
    log = os.path.join(outdir, name + ".log")
    for old in (xml, log):
        if os.path.exists(old):
            os.unlink(old)
    slot = slots.get()      # a port slice no other running file has
    t0 = time.time()
    try:
        with open(log, "wb") as out:
            rc = subprocess.run(pytest_argv(xml, [os.path.relpath(path, TOP)]), cwd=TOP,
                                env=pytest_env(build, sanitize, "%d/%d" % (slot, jobs)),
                                stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL).returncode
    finally:
        slots.put(slot)
    return name, xml, log, rc, time.time() - t0


def report_file(name, log, counts, secs):
    p, f, s = counts
    print("integration %-27s %3d passed %3d failed %2d skipped %6.1fs  %s"
          % (name, p, f, s, secs, "ok" if f == 0 else "FAILED"), flush=True)
    if f:
        with open(log, errors="replace") as fh:
            lines = fh.read().splitlines()
        sys.stdout.write("".join("    " + l + "\n" for l in lines[-LOG_LINES:]))
        print("    (whole output: %s)" % log, flush=True)


def merge_xml(build, parts):
    """One junit file with every file's suite, as one pytest run wrote."""
    root = ET.Element("testsuites")
    for xml in parts:
        if os.path.exists(xml):
            r = ET.parse(xml).getroot()
            root.extend([r] if r.tag == "testsuite" else r.findall("testsuite"))
    ET.ElementTree(root).write(os.path.join(build, "pytest.xml"), encoding="utf-8",
                               xml_declaration=True)


def run_integration(build, sanitize, jobs):
    """Every file in t/integration, one pytest process each, jobs at a time.
    Files share nothing: each test makes its own processes and directories
    (t/lib/kvt.py), and each running file draws its ports from its own
    slice of the range."""
    files = file_order(build, glob.glob(os.path.join(TOP, "t", "integration", "test_*.py")))
    outdir = os.path.join(build, "pytest")
    os.makedirs(outdir, exist_ok=True)
    totals = [0, 0, 0]
    times, parts = {}, []
    slots = queue.Queue()
    for i in range(jobs):
        slots.put(i)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        running = [pool.submit(run_file, build, sanitize, f, outdir, slots, jobs) for f in files]
        for done in as_completed(running):
            name, xml, log, rc, secs = done.result()
            counts = count_xml(xml, rc)
            report_file(name, log, counts, secs)
            totals = [a + b for a, b in zip(totals, counts)]
            times[name + ".py"] = round(secs, 1)
            parts.append(xml)
    merge_xml(build, sorted(parts))
    with open(os.path.join(build, "pytest-times.json"), "w") as f:
        json.dump(times, f, indent=0, sort_keys=True)
    return tuple(totals)


def default_jobs():
    """KVROUTE_TEST_JOBS, else one per core up to 4."""
    try:
        return max(1, int(os.environ["KVROUTE_TEST_JOBS"]))
    except (KeyError, ValueError):
        return max(1, min(4, os.cpu_count() or 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--sanitize", default="0")
    ap.add_argument("--unit-only", action="store_true")
    ap.add_argument("--jobs", type=int, default=0,
                    help="unit binaries and integration files run at once (default: KVROUTE_TEST_JOBS, else "
                         "one per core up to 4)")
    ap.add_argument("select", nargs="*", help="pytest selection (default: t/integration)")
    a = ap.parse_args()
    sanitize = a.sanitize == "1"
    t0 = time.time()
    jobs = a.jobs or default_jobs()
    p1, f1 = (0, 0) if a.select else run_unit(a.build, sanitize, jobs)
    p2 = f2 = s2 = 0
    if not a.unit_only:
        if a.select:
            p2, f2, s2 = run_selection(a.build, sanitize, a.select)
        else:
            p2, f2, s2 = run_integration(a.build, sanitize, jobs)
    print("\nunit: %d passed, %d failed; integration: %d passed, %d failed, %d skipped; %.0fs"
          % (p1, f1, p2, f2, s2, time.time() - t0))
    line = "%d passed, %d failed" % (p1 + p2, f1 + f2)
    if s2:
        line += ", %d skipped" % s2
    print(line)
    return 1 if f1 + f2 else 0


if __name__ == "__main__":
    sys.exit(main())
