#!/bin/bash
# Busy-poll off (0) and on (default), alternating, order swapped per round:
# strict leases on A,C,D,M, and figure Wk's shardq rows. Run from the project root.
out=docs/perf/busy-poll-2026-12-02/final
run() {  # tag round busy extra-args...
  local tag=$1 round=$2 b=$3; shift 3
  local opt=""; [ $b = 0 ] && opt="--busy-poll-us 0"
  timeout 900 .venv/bin/python -m bench.run --only shardq --runs 1 --no-scaling --no-install $opt "$@" \
    --json $out/$tag-$round-busy-$b.json > $out/$tag-$round-busy-$b.txt 2>&1
  echo "$tag round $round busy=$b: $(python3 -c "
import json; r=json.load(open('$out/$tag-$round-busy-$b.json'))
f=dict(r['peers'].get('shardq', {}).get('figures', {}), **r.get('wk', {}))
print({k: {m: round(x, 1) for m, x in v['summary'].items() if isinstance(x, (int, float))} for k, v in f.items()})")"
}
for round in 1 2; do
  if [ $((round % 2)) = 1 ]; then order="0 default"; else order="default 0"; fi
  for b in $order; do run strict $round $b --figures A,C,D,M --lease-sync strict; done
  for b in $order; do run wk $round $b --figures Wk --runners shardq,shardq-idem; done
done
