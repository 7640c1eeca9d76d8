#!/bin/bash
cd /work/main
for round in 1 2; do
for c in 0 50 100 300; do
  for op in lease-ack enqueue; do
    r=$(SQ_SPIN_CLIENT_US=$c timeout 300 .venv/bin/python -m bench.call_floor --runs 1 --calls 2000 --op $op --peers shardq 2>&1 | grep "^shardq " | head -1)
    echo "round $round client=$c $op: " $r
  done
done
done
