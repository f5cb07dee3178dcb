#!/usr/bin/env bash
# In + out together: the step's background swap-outs issued after its swap-ins (the default)
# against before them (PENSIEVE_SWAP_OUT_FIRST=1), on one GPU, alternated ROUNDS times so that
# the machine's drift shows as the spread within each order. Per round and order:
#   swap_bandwidth.py --methods staged (GB/s each way, in alone / out alone / in + out, the
#     raw two-stream rate of the same call, and when the swap-ins of in + out were done), and
#   swap_timeline.py --bare at 64 and 256 chunks (the compute stream's marks for layer 0 and
#     the last layer, without the per-copy brackets).
# Writes to $OUT (default results_tmp): bw_{after,first}_R.{txt,json}, tl_{after,first}_R.txt,
# and summary.txt (the in + out rows side by side).
#   OUT=/tmp/order ROUNDS=2 REPS=4 bash benchmarks/swap_out_order.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-results_tmp}; mkdir -p "$out"
rounds=${ROUNDS:-2}; reps=${REPS:-4}
for r in $(seq 1 "$rounds"); do
  for order in after first; do
    flag=0; [ $order = first ] && flag=1
    echo "== round $r, swap-outs $order the swap-ins (PENSIEVE_SWAP_OUT_FIRST=$flag)"
    PENSIEVE_SWAP_OUT_FIRST=$flag python benchmarks/swap_bandwidth.py --methods staged \
      --sweep-programs --reps "$reps" --out "$out/bw_${order}_$r.json" \
      > "$out/bw_${order}_$r.txt" 2>&1 || echo "swap_bandwidth failed: see bw_${order}_$r.txt"
    PENSIEVE_SWAP_OUT_FIRST=$flag python benchmarks/swap_timeline.py --chunks 64 256 \
      --dirs in+out --reps 3 --bare --label "$order: " > "$out/tl_${order}_$r.txt" 2>&1 \
      || echo "swap_timeline failed: see tl_${order}_$r.txt"
  done
done
for f in "$out"/bw_*_*.txt "$out"/tl_*_*.txt; do
  echo "== $(basename "$f")"
  tail -n 30 "$f"
done > "$out/summary.txt"
grep -h -A12 "== bw_" "$out/summary.txt" | head -80
