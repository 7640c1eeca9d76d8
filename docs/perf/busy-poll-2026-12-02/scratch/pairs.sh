#!/bin/bash
# alternating pairs: busy_poll_us 0 vs the default; figures of $FIGS
cd /work/main
FIGS=${FIGS:-A,C,D,M,B-threads}
for round in $(seq 1 ${ROUNDS:-2}); do
for c in 0 default; do
  opt=""; [ $c = 0 ] && opt="--busy-poll-us 0"
  timeout 600 .venv/bin/python -m bench.run --figures $FIGS --only shardq --runs 1 --no-scaling --no-install $opt --json /tmp/s30/pairs-$TAG-$round-$c.json > /tmp/s30/pairs-$TAG-$round-$c.txt 2>&1
  echo "round $round busy=$c: $(python3 -c "
import json; r=json.load(open('/tmp/s30/pairs-$TAG-$round-$c.json'))
f=r['peers']['shardq']['figures']
print({k: round(v['summary'].get('jobs_per_s') or v['summary'].get('p99_ms') or 0, 2) for k,v in f.items()})")"
done
done
