#!/bin/bash
# alternate spin settings; lease-ack and enqueue, disk, any CPUs
cd /work/main
for round in 1 2; do
for cfg in "0 0" "200 200" "0 200" "200 0"; do
  set -- $cfg
  for op in lease-ack enqueue; do
    r=$(SQ_SPIN_SHARD_US=$1 SQ_SPIN_CLIENT_US=$2 timeout 300 .venv/bin/python -m bench.call_floor --runs 1 --calls 2000 --op $op --peers shardq 2>&1 | grep "^shardq \|^floor ")
    echo "round $round shard=$1 client=$2 $op: " $r
  done
done
done
