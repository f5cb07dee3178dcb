#!/usr/bin/env bash
# In + out together: the step's background swap-outs issued after its swap-ins (the default,
# order "after") against before them (PENSIEVE_SWAP_OUT_FIRST=1, "first"): the orders in
# ORDERS (default "after first"), each with the swap-outs gathered and copied
# by each count of groups of layers in OUT_GROUPS (PENSIEVE_SWAP_OUT_GROUPS, default 8), on one GPU,
# alternated ROUNDS times so that the machine's drift shows as the spread within each setting.
# Per round, order and groups:
#   swap_bandwidth.py --methods staged --steps STEPS (GB/s each way, in alone / out alone /
#     in + out, the raw two-stream rate of the same call, and when the swap-ins of in + out
#     were done; and STEPS (default 8) in + out steps back to back, as serving issues them), and
#   with TIMELINE=1, swap_timeline.py --bare at 64 and 256 chunks (the compute stream's marks
#     for layer 0 and the last layer, without the per-copy brackets).
# A round is not started once BUDGET_S seconds (default: none) have passed.
# Writes to $OUT (default results_tmp): bw_<order>_g<groups>_<round>.{txt,json},
# tl_<order>_g<groups>_<round>.txt, and in_out_table.txt (benchmarks/swap_in_out_table.py).
#   OUT=/tmp/order ROUNDS=2 REPS=4 OUT_GROUPS="1 8" bash benchmarks/swap_out_order.sh
#   OUT=/tmp/order ORDERS=after OUT_GROUPS="1 8" bash benchmarks/swap_out_order.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-results_tmp}; mkdir -p "$out"
rounds=${ROUNDS:-2}; reps=${REPS:-4}; groups=${OUT_GROUPS:-8}; budget=${BUDGET_S:-0}
start=$SECONDS
for r in $(seq 1 "$rounds"); do
  if [ "$budget" -gt 0 ] && [ $((SECONDS - start)) -ge "$budget" ]; then
    echo "budget of ${budget} s spent: rounds $r.. not run"; break
  fi
  for order in ${ORDERS:-after first}; do
    flag=0; [ "$order" = first ] && flag=1
    for g in $groups; do
      tag=${order}_g${g}_$r
      echo "== round $r, swap-outs $order the swap-ins, by $g group(s) of layers" \
           "($((SECONDS - start)) s)"
      PENSIEVE_SWAP_OUT_FIRST=$flag \
        PENSIEVE_SWAP_OUT_GROUPS=$g python benchmarks/swap_bandwidth.py --methods staged \
        --sweep-programs --steps "${STEPS:-8}" --reps "$reps" --out "$out/bw_$tag.json" > "$out/bw_$tag.txt" 2>&1 \
        || echo "swap_bandwidth failed: see bw_$tag.txt"
      if [ "${TIMELINE:-0}" = 1 ]; then
        PENSIEVE_SWAP_OUT_FIRST=$flag \
          PENSIEVE_SWAP_OUT_GROUPS=$g python benchmarks/swap_timeline.py --chunks 64 256 \
          --dirs in+out --reps 3 --bare --label "$order g$g: " > "$out/tl_$tag.txt" 2>&1 \
          || echo "swap_timeline failed: see tl_$tag.txt"
      fi
    done
  done
done
python benchmarks/swap_in_out_table.py "$out" | tee "$out/in_out_table.txt"
