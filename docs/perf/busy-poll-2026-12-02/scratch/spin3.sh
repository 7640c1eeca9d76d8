#!/bin/bash
cd /work/main
for round in 1 2; do
for c in 0 300; do
  SQ_SPIN_CLIENT_US=$c timeout 600 .venv/bin/python -m bench.run --figures A,C,D,M,B-threads --only shardq --runs 1 --no-scaling --no-install --json /tmp/s30/spin3-$round-$c.json > /tmp/s30/spin3-$round-$c.txt 2>&1
  echo "round $round client=$c: $(python3 -c "
import json; r=json.load(open('/tmp/s30/spin3-$round-$c.json'))
f=r['peers']['shardq']['figures']
print({k: round(v['summary'].get('jobs_per_s') or 0) for k,v in f.items()})")"
done
done
