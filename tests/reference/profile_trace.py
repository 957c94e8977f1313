"""Sums a Chrome/Perfetto trace's events per name, as the table of a profile
(ops.csv) sums them (tests/cli_tools.rs, `kiln train --profile`): an independent
reading of the trace file, with its own nesting of events per thread.

Usage: profile_trace.py TRACE.json

Prints one JSON object: {name: [calls, self_us, total_us]}, where every
`ProfilerStep#N` range counts under `ProfilerStep*`. Host events are the
operators and the marked ranges (categories cpu_op and user_annotation; op and
range in Kiln's TensorFlow trace); a host event's self time is its duration
less that of the events directly inside it on the same thread, except for
TensorFlow's graph nodes (category op), which never contain one another.
"""

import json
import sys
from collections import defaultdict

HOST = {"cpu_op", "user_annotation", "op", "range"}


def main():
    with open(sys.argv[1]) as f:
        trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in HOST]
    by_thread = defaultdict(list)
    for e in events:
        e["self"] = e["dur"]
        if e["cat"] != "op":
            by_thread[(e["pid"], e["tid"])].append(e)
    sums = defaultdict(lambda: [0, 0.0, 0.0])
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                parent = stack[-1]
                inside = min(e["ts"] + e["dur"], parent["ts"] + parent["dur"]) - e["ts"]
                parent["self"] = max(parent["self"] - inside, 0.0)
            stack.append(e)
    for e in events:
        name = "ProfilerStep*" if e["name"].startswith("ProfilerStep#") else e["name"]
        row = sums[name]
        row[0] += 1
        row[1] += e["self"]
        row[2] += e["dur"]
    json.dump(sums, sys.stdout)


if __name__ == "__main__":
    main()
