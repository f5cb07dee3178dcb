"""Per-token step costs from a server's own step accounting (its ``/metrics``).

``pensieve serve`` exports, since it started, the executor seconds and the number of steps by
step kind (``prefill``: the step computed prompt or recomputed-history tokens, with the decodes
that rode along; ``decode``: decodes only), the tokens computed by kind, the scheduler's host
seconds and the chunks moved between the tiers. This prints, per server:

- ``us / prefill token``: executor seconds of prefill steps / prefill tokens computed (what
  issue 13 compares between policies);
- ``us / prefill token, net``: the same after taking out what the step's decodes would have
  cost alone (the mean decode-step time per prefill step);
- decode step mean, scheduler host ms per step, urgent share of swap-outs;
- the runner's host time per step, by step kind, next to the step's time: ``prepare`` (until
  the forward is launched: the device idles meanwhile, the previous step having ended with a
  synchronisation) and ``issue`` (until the whole forward is issued; near the step time: a
  host-bound step). Servers of before these counters print 0.

Input: ``metrics_end.txt`` files (what ``benchmarks/churn_points.sh`` saves in ``churn.tgz``), a
``churn.tgz`` itself, or a server URL (``http://host:port``). In-process runs
(``MODE=inproc``) have no server: their ``steps.jsonl(.gz)`` (every engine step with its host
times, ``multiturn.py --engine real``) is summed into the same counters, as is a server's own
step log (``PENSIEVE_STEP_LOG``, saved by ``churn_points.sh``)::

    python benchmarks/step_totals.py A/churn.tgz
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tarfile
from pathlib import Path

_LINE = re.compile(r'^(pensieve_[a-z_]+)(?:\{(\w+)="([^"]*)"\})? ([0-9.eE+-]+)$')


def parse(text: str) -> dict[str, float]:
    """``name`` or ``name:label`` -> value, for the pensieve_* samples of a metrics page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            name, _, label, value = m.groups()
            out[f"{name}:{label}" if label else name] = float(value)
    return out


def costs(m: dict[str, float]) -> dict[str, float]:
    steps_p = m.get("pensieve_steps_total:prefill", 0.0)
    steps_d = m.get("pensieve_steps_total:decode", 0.0)
    sec_p = m.get("pensieve_step_execute_seconds_total:prefill", 0.0)
    sec_d = m.get("pensieve_step_execute_seconds_total:decode", 0.0)
    tok_p = m.get("pensieve_computed_tokens_total:prefill", 0.0)
    decode_step = sec_d / steps_d if steps_d else 0.0
    sched = (m.get("pensieve_scheduler_seconds_total:schedule", 0.0)
             + m.get("pensieve_scheduler_seconds_total:update", 0.0))
    out_bg = m.get("pensieve_swap_chunks_total:out", 0.0)
    out_urgent = m.get("pensieve_swap_chunks_total:out_urgent", 0.0)
    def per_step(name: str, kind: str, n: float) -> float:
        return 1e3 * m.get(f"pensieve_step_host_{name}_seconds_total:{kind}", 0.0) / n if n \
            else 0.0

    def per_all(key: str) -> float:
        return 1e3 * m.get(key, 0.0) / (steps_p + steps_d) if steps_p + steps_d else 0.0

    return {
        "prefill_host_prepare_ms": per_step("prepare", "prefill", steps_p),
        "prefill_host_issue_ms": per_step("issue", "prefill", steps_p),
        "decode_host_prepare_ms": per_step("prepare", "decode", steps_d),
        "decode_host_issue_ms": per_step("issue", "decode", steps_d),
        "prefill_steps": steps_p, "decode_steps": steps_d,
        "prefill_tokens": tok_p,
        "us_per_prefill_token": 1e6 * sec_p / tok_p if tok_p else 0.0,
        "us_per_prefill_token_net": 1e6 * (sec_p - steps_p * decode_step) / tok_p
        if tok_p else 0.0,
        "prefill_step_ms": 1e3 * sec_p / steps_p if steps_p else 0.0,
        "decode_step_ms": 1e3 * decode_step,
        "scheduler_ms_per_step": 1e3 * sched / (steps_p + steps_d) if steps_p + steps_d else 0.0,
        "disk_wait_ms_per_step": per_all("pensieve_disk_step_seconds_total:wait"),
        "disk_apply_ms_per_step": per_all("pensieve_disk_step_seconds_total:apply"),
        "swap_in_chunks": m.get("pensieve_swap_chunks_total:in", 0.0),
        "swap_out_chunks": out_bg + out_urgent,
        "urgent_swap_out_share": out_urgent / (out_bg + out_urgent) if out_bg + out_urgent
        else 0.0,
        "split_span_share": m.get("pensieve_decode_split_span_steps_total", 0.0) / steps_d
        if steps_d else 0.0,
        "prefill_graph_share": m.get("pensieve_graph_steps_total:prefill", 0.0) / steps_p
        if steps_p else 0.0,
    }


def totals_of_steps(lines: list[str]) -> dict[str, float]:
    """The ``/metrics`` counters :func:`costs` reads, summed from ``steps.jsonl`` rows (those
    written before the rows had host times count the step time as executor time)."""
    m: dict[str, float] = {}

    def add(key: str, v: float) -> None:
        m[key] = m.get(key, 0.0) + v

    for line in lines:
        if not line.strip():
            continue
        d = json.loads(line)
        if "prefill_tokens" in d:  # a server's PENSIEVE_STEP_LOG row (StepRecord.as_dict)
            d = {"num_prefill_tokens": d["prefill_tokens"], "time_s": d["execute_s"],
                 "host": {"execute_s": d["execute_s"], "prepare_s": d["host_prepare_s"],
                          "issue_s": d["host_issue_s"], "schedule_s": d["schedule_s"],
                          "update_s": d["update_s"]}, **d}
        host = d.get("host") or {}
        kind = "prefill" if d.get("num_prefill_tokens", 0) > 0 else "decode"
        add(f"pensieve_steps_total:{kind}", 1)
        add(f"pensieve_step_execute_seconds_total:{kind}", host.get("execute_s", d["time_s"]))
        add(f"pensieve_step_host_prepare_seconds_total:{kind}", host.get("prepare_s", 0.0))
        add(f"pensieve_step_host_issue_seconds_total:{kind}", host.get("issue_s", 0.0))
        add(f"pensieve_graph_steps_total:{kind}", float(d.get("graph_replay", False)))
        add("pensieve_computed_tokens_total:prefill", d.get("num_prefill_tokens", 0))
        add("pensieve_scheduler_seconds_total:schedule", host.get("schedule_s", 0.0))
        add("pensieve_scheduler_seconds_total:update", host.get("update_s", 0.0))
        add("pensieve_disk_step_seconds_total:wait", d.get("disk_wait_s", 0.0))
        add("pensieve_disk_step_seconds_total:apply", d.get("disk_apply_s", 0.0))
        add("pensieve_swap_chunks_total:in", d.get("swap_in_chunks", 0))
        urgent = d.get("urgent_swap_out_chunks", 0)
        add("pensieve_swap_chunks_total:out_urgent", urgent)
        add("pensieve_swap_chunks_total:out", d.get("swap_out_chunks", 0) - urgent)
    return m


def sources(arg: str) -> list[tuple[str, dict[str, float]]]:
    """(name, counters) for each server or in-process run the argument names."""
    if arg.startswith("http://") or arg.startswith("https://"):
        import httpx

        return [(arg, parse(httpx.get(arg.rstrip("/") + "/metrics", timeout=10).text))]
    p = Path(arg)
    if p.name.startswith("steps.jsonl"):
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt") as fh:
            return [(str(p), totals_of_steps(fh.readlines()))]
    if p.suffix in (".tgz", ".gz") and tarfile.is_tarfile(p):
        found = []
        for member, raw in archive_files(p).items():
            base = member.rsplit("/", 1)[-1]
            name = f"{p.parent.name}/{member}"
            if base == "metrics_end.txt":
                found.append((name, parse(raw.decode())))
            elif base in ("steps.jsonl", "steps.jsonl.gz"):
                text = gzip.decompress(raw) if base.endswith(".gz") else raw
                found.append((name, totals_of_steps(text.decode().splitlines())))
        return found
    return [(str(p), parse(p.read_text()))]


def archive_files(path: str | Path) -> dict[str, bytes]:
    """The regular files of a ``churn.tgz`` (what ``benchmarks/churn_points.sh`` saves), in
    archive order: member name as stored (``./A/points.jsonl`` or ``A/points.jsonl``) ->
    bytes."""
    out: dict[str, bytes] = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            f = tar.extractfile(member) if member.isfile() else None
            if f is not None:
                out[member.name] = f.read()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="metrics_end.txt, steps.jsonl(.gz), churn.tgz or "
                    "http://host:port")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write {name: costs} as JSON (the acceptance docs read it)")
    args = ap.parse_args(argv)
    keys = ("us_per_prefill_token", "us_per_prefill_token_net", "prefill_step_ms",
            "decode_step_ms", "scheduler_ms_per_step", "disk_wait_ms_per_step",
            "disk_apply_ms_per_step", "urgent_swap_out_share")
    host = ("prefill_step_ms", "prefill_host_prepare_ms", "prefill_host_issue_ms",
            "decode_step_ms", "decode_host_prepare_ms", "decode_host_issue_ms",
            "prefill_graph_share")
    found = [(name, costs(m)) for arg in args.inputs for name, m in sources(arg)]
    for cols in (keys, host):
        print(f"{'server':48} " + " ".join(f"{k:>26}" for k in cols))
        for name, c in found:
            print(f"{name[-48:]:48} " + " ".join(f"{c[k]:26.3f}" for k in cols))
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({name: c for name, c in found}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
