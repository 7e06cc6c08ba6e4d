"""gap.py OUT...: OUT is a bench-disagg --out directory with a 4p4d-c-k3072 fleet.
For remote requests joined to their kvbench record (unique prompt length),
the client's TTFT minus nginx's header time, and mean TTFT per reason/kind."""
import json, os, sys, statistics as st, importlib.machinery, importlib.util
ld = importlib.machinery.SourceFileLoader("bd", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools", "bench-disagg"))
spec = importlib.util.spec_from_loader("bd", ld); bd = importlib.util.module_from_spec(spec); ld.exec_module(bd)
for d in sys.argv[1:]:
    rows = bd.read_decisions(d + "/4p4d-c-k3072.decisions.log")
    recs = [json.loads(l) for l in open(d + "/4p4d-c-k3072.jsonl")]
    by = {}
    for r in recs: by.setdefault(r["input_length"], []).append(r)
    gaps = {"long": [], "short": []}
    for r in rows:
        if r["reason"] != "remote" or r["header_s"] is None: continue
        rr = by.get(int(r["prompt_tokens"]))
        if rr and len(rr) == 1:
            gaps["long" if r["prompt_tokens"] >= 8192 else "short"].append(rr[0]["ttft_ms"] - r["header_s"] * 1000)
    allt = [r["ttft_ms"] for r in recs if r.get("ttft_ms") is not None]
    print(d.split("/")[-1], "remote TTFT-header ms: long n=%d mean %.0f median %.0f; short n=%d mean %.0f median %.0f; all-request TTFT mean %.0f" % (
        len(gaps["long"]), st.mean(gaps["long"]), st.median(gaps["long"]),
        len(gaps["short"]), st.mean(gaps["short"]), st.median(gaps["short"]), st.mean(allt)))
