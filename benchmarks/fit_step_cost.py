"""Fit the simulator's step-cost model to step records measured on a device.

    python benchmarks/fit_step_cost.py results/multiturn/steps.jsonl --out step_cost.json

Each record is one engine step of a real run (`benchmarks/multiturn.py` writes them): its
features (prefill and decode tokens, attention pairs, KV read, swaps) and its measured time.
Prints the fit's relative error; records of the HF peer are skipped.
"""

from __future__ import annotations

import argparse
import gzip
import json

from pensieve.bench.step_cost import StepCostModel, StepFeatures, relative_errors

CHUNK_BYTES_13B = 32 * 2 * 40 * 10 * 128 * 2  # one chunk, all layers, K and V, bf16
PCIE_BYTES_PER_S = 55e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steps", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES_13B)
    ap.add_argument("--label", default="H200, llama2-13b-gqa10, bf16, dummy weights")
    ap.add_argument("--relative", action="store_true",
                    help="minimise relative errors per step (default: absolute seconds, which "
                         "weighs the few long prefill-heavy steps as the run's time does)")
    args = ap.parse_args()
    recs = []
    for path in args.steps:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            for line in f:
                d = json.loads(line)
                if d.pop("system") == "hf":
                    continue
                t = d.pop("time_s")
                d.pop("host", None)  # host times (step_totals.py), not features
                recs.append((StepFeatures.from_dict(d), t))
    model = StepCostModel.fit(recs, swap_copy_chunk_s=args.chunk_bytes / PCIE_BYTES_PER_S,
                              relative=args.relative, label=args.label)
    model.save(args.out)
    err = relative_errors(model, recs)
    print(json.dumps({"records": len(recs), **{k: round(v, 4) for k, v in err.items()},
                      "coefficients": model.coefficients}, indent=2))


if __name__ == "__main__":
    main()
