"""Paired ratios new/old of shardq's jobs/s per figure, from the JSON files that pairs.sh
wrote (old-I.json, new-I.json). Usage: python cmp.py DIR A,C,D,M"""
import json, os, statistics, sys

d, figs = sys.argv[1], sys.argv[2].split(",")


def jobs_per_s(result: dict, fig: str):
    try:
        return result["peers"]["shardq"]["figures"][fig]["summary"]["jobs_per_s"]
    except KeyError:
        return None


ratios = {f: [] for f in figs}
i = 1
while os.path.exists(f"{d}/new-{i}.json") and os.path.exists(f"{d}/old-{i}.json"):
    old, new = json.load(open(f"{d}/old-{i}.json")), json.load(open(f"{d}/new-{i}.json"))
    row = []
    for f in figs:
        a, b = jobs_per_s(old, f), jobs_per_s(new, f)
        if a and b:
            ratios[f].append(b / a)
            row.append(f"{f} {a:.0f}->{b:.0f} ({b / a:.2f})")
    print(i, " ".join(row))
    i += 1
for f in figs:
    if ratios[f]:
        print(f, "median paired", round(statistics.median(ratios[f]), 2))
