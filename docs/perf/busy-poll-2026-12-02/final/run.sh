#!/bin/sh
# Both sides' busy-poll on (default, 300 us) and off (0), alternating, order swapped per round.
# Run from the project root: sh docs/perf/busy-poll-2026-12-02/final/run.sh
out=docs/perf/busy-poll-2026-12-02/final
for round in 1 2 3 4; do
  if [ $((round % 2)) = 1 ]; then order="default 0"; else order="0 default"; fi
  for op in enqueue lease-ack; do
    for b in $order; do
      if [ $b = default ]; then arg=""; else arg="--shardq-busy-poll-us 0"; fi
      echo "== round $round op $op busy $b"
      .venv/bin/python -m bench.probes.call_floor --op $op --runs 3 --calls 2000 --peers shardq,beanstalkd $arg \
        --json $out/floor-$op-busy-$b-$round.json
    done
  done
done
