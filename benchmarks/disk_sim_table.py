"""The table of docs/performance_history.md "Disk tier under long idle, simulated" from the
points of ``benchmarks/sim_disk_long_idle.sh``:

    python benchmarks/disk_sim_table.py POINTS.jsonl...
"""

from __future__ import annotations

import json
import sys

KV_BYTES_PER_TOKEN = 2 * 40 * 10 * 128 * 2  # Llama 2-13B GQA-10, bf16


def row(d: dict) -> str:
    disk = d.get("disk", {})
    st = d["steady"]["halves"]
    sessions = sum(st["sessions_in_flight"]) / 2
    live_gb = sessions * d["mean_context_len"] * KV_BYTES_PER_TOKEN / 1e9
    tiers_gb = (d["gpu_kv_gb"] + d["cpu_kv_gb"]) * 2**30 / 1e9
    src = " / ".join(f"{100 * d[k]:.1f}" for k in ("gpu_hit_rate", "cpu_hit_rate",
                                                   "disk_hit_rate", "recomputed_rate",
                                                   "new_prompt_rate"))
    if disk:
        label = f"200 GB at {disk['disk_read_gbps']:g} GB/s"
        if disk.get("disk_prefetch", "all") == "all":  # the engine: worth-reading
            label += ", what-if: prefetch all"
        io = (f"{disk['disk_read_bytes'] / 1e9:.0f} / {disk['disk_write_bytes'] / 1e9:.0f} | "
              f"{disk['disk_restored_chunks']} | {disk['disk_read_wait_us'] / 1e6:.0f} s in "
              f"{disk['disk_read_waits']} steps")
    else:
        label, io = "no disk tier", "- | - | -"
    return (f"| {d['conv_rate']:g} | {label} | {d['throughput_rps']:.3f} | "
            f"{1e3 * d['ttft_s_p50']:.0f} / {1e3 * d['ttft_s_p90']:.0f} | {src} | "
            f"{d['prefill_computed_per_turn']:.0f} | {io} | {sessions:.0f}, "
            f"{live_gb / tiers_gb:.1f}x | {d['steady_state']} |")


def main(paths: list[str]) -> None:
    print("| sessions/s | disk | req/s | TTFT P50 / P90 ms | context: gpu / cpu / disk / "
          "recomputed / new % | prefill computed per turn | disk read / written GB | "
          "chunks read back | steps' wait for reads | live sessions, their KV / tiers | "
          "steady |")
    print("| ---: | --- | ---: | --- | --- | ---: | --- | ---: | --- | --- | --- |")
    for p in paths:
        for line in open(p):
            print(row(json.loads(line)))


if __name__ == "__main__":
    main(sys.argv[1:])
