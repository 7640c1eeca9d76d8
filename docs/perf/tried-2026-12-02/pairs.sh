#!/bin/bash
# Alternating before/after runs of bench.run for shardq alone, order swapped every pair.
# usage: OLD=tree-before NEW=tree-after PY=python pairs.sh N FIGURES OUTDIR
# (each tree a checkout; bench.run imports shardq from the tree it runs in)
N=$1; FIG=$2; OUT=$3; mkdir -p "$OUT"
for i in $(seq 1 "$N"); do
  if [ $((i % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for w in $order; do
    if [ "$w" = old ]; then t=$OLD; else t=$NEW; fi
    (cd "$t" && "$PY" -m bench.run --figures "$FIG" --only shardq --runs 1 --no-scaling \
        --no-install --json "$OUT/$w-$i.json" > "$OUT/$w-$i.log" 2>&1)
  done
done
