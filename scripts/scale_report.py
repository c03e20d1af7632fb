"""What ``make scale`` says of its rows: the table, whether this machine held each phase, the
targets each size met, and the growth exponent."""

from __future__ import annotations

import math
import os
from typing import Any

from store_load import CAPACITY_CLIENTS

MILESTONES = {"checked in": max, "silence seen": min, "closed": min}
"""The agreement's milestones (scale.py's ``Node``), each the last node's (``max``) or the
first watcher's (``min``)."""


def table(rows: list[dict[str, Any]], cap: float) -> str:
    """The rows as a Markdown table, and what was measured beside them, in sentences."""
    def num(v: float | None, fmt: str = ".1f") -> str:
        return "—" if v is None else format(v, fmt)

    lines = [("| ranks (nodes) | store ops/s (model) | per rank | bytes/s | busiest second: "
              "steady, fault (share of capacity) | hang verdict (s) | agreed membership (s) |"),
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        def mark(*phases: str, row: dict[str, Any] = r) -> str:
            return NOT_HELD_MARK if any(phase in row.get("not_held", {})
                                        for phase in phases) else ""

        lines.append(
            f"| {r['ranks']} ({r['nodes']}) | {r['steady_ops_s']:,.0f} "
            f"({r['model_ops_s']:,.0f}){mark('steady')} | "
            f"{r['steady_ops_s_per_rank']:.1f} | {r['steady_bytes_s'] / 1e6:.2f} MB | "
            f"{r['busiest_second_steady']:,}{mark('steady')}, {r['busiest_second_fault']:,}"
            f"{mark(r['busiest_second_fault_phase'])} ({r['busiest_fraction_of_capacity']:.0%}) | "
            f"{num(r['hang_verdict_s'])}{mark('hang')} | {num(r['agreed_s'])}"
            f"{mark('lost node')} |")
    if any(r.get("not_held") for r in rows):
        lines.append(f"\n{NOT_HELD_MARK} Measured in a phase this machine did not hold: its "
                     f"cores were {SATURATED:.0%} busy or more with the simulated ranks and the "
                     "store, and the simulated ranks queued for them (the run's last line says "
                     "which, and why).")
    lines.append(f"\nThe store's capacity here: {cap:,.0f} operations a second "
                 f"({CAPACITY_CLIENTS} client processes). The model's figure is what the job's "
                 "periods ask for; where the count falls short of it, this machine's cores could "
                 "not drive every simulated rank.")
    lines.append("The simulating processes' share of the machine's cores (steady, hang, lost "
                 "node): " + "; ".join(
                     f"{r['ranks']} ranks " + ", ".join(
                         f"{share:.0%}" for share in r["simulation_cpu_share"].values())
                     for r in rows) + ".")
    def load(r: dict[str, Any], phase: str) -> str:
        trip = r["store_round_trip_ms"][phase]
        return (f"{num(r['store_cpu_share'][phase], '.0%')} "
                + ("—" if trip is None else f"{trip[0]:.1f}/{trip[1]:.1f} ms"))

    lines.append("The store's own process (one event loop), its share of one core and the round "
                 "trip of a client that asks nothing else, median/99th percentile (steady, "
                 "hang, lost node): " + "; ".join(
                     f"{r['ranks']} ranks " + ", ".join(load(r, phase)
                                                        for phase in r["store_cpu_share"])
                     for r in rows) + ".")
    faults = [r for r in rows if r.get("busiest_second_fault_ops")]
    if faults:
        lines.append("The busiest second of the fault, its phase and what it was made of: "
                     + "; ".join(f"{r['ranks']} ranks in the {r['busiest_second_fault_phase']}, "
                                 + ", ".join(f"{n:,} {op}" for op, n in sorted(
                                     r["busiest_second_fault_ops"].items(),
                                     key=lambda item: -item[1]))
                                 for r in faults) + ".")
    after = [r for r in rows if r.get("hang_agreed_s") is not None]
    if after:
        lines.append("After the hang, every survivor had the record of who is left (all but the "
                     "hung rank) this long after the verdict, the last survivor checked in and "
                     "the first watcher closed it: " + "; ".join(
                         f"{r['ranks']} ranks {r['hang_agreed_s']:.2f} s ("
                         + ", ".join(num(r.get("hang_agreement_milestones_s", {}).get(name),
                                         ".2f") for name in ("checked in", "closed")) + ")"
                         for r in after) + ".")
    agreed = [r for r in rows if r.get("agreement_milestones_s")]
    if agreed:
        lines.append("Where the agreement's time went, in seconds after the node was lost (the "
                     "last survivor checked in; the first watcher had seen the lost node's "
                     "silence, closed the membership): " + "; ".join(
                         f"{r['ranks']} ranks " + ", ".join(
                             num(r["agreement_milestones_s"].get(name), ".2f")
                             for name in MILESTONES) for r in agreed) + ".")
    for r in rows:
        if r["store_errors"]:
            lines.append(f"At {r['ranks']} ranks, {sum(r['store_errors'].values()):,} store "
                         f"calls failed, e.g. \"{next(iter(r['store_errors']))}\".")
    return "\n".join(lines)
NOT_HELD_MARK = "†"
SATURATED = 0.8
"""A phase in which the simulated ranks and the store kept this share of the machine's cores
busy is not held here: its simulated ranks queued for the cores (a rank of a job has its own),
and its times are that queue's, not the store's or the design's. At 8,000 ranks on 2 cores the
fault's phases keep 90-96% of them busy: the survivors' three operations each to check in took
8 s, and a watcher's own pulse (the clock of its silence verdicts) moved at a fraction of its
rate (at 2,048 ranks: 40-45%, check-ins done in 0.2 s)."""
DRIVEN = 0.95
"""The steady state is held where the simulated ranks made this share of what the job's
periods ask of the store (the model), or more."""


def not_held(row: dict[str, Any]) -> dict[str, str]:
    """The phases of a size's row that this machine did not hold, and why."""
    held: dict[str, str] = {}
    if row["driven"] < DRIVEN:
        held["steady"] = (f"the simulated ranks made {row['driven']:.0%} of the operations "
                          "their periods ask for")
    for phase, busy in row["machine_busy"].items():
        if busy >= SATURATED:
            held.setdefault(phase, f"the simulated ranks and the store kept {busy:.0%} of this "
                                   f"machine's {os.cpu_count()} cores busy")
    return held


def why_stopped(row: dict[str, Any], budget_s: float) -> list[str]:
    """Why a size's row ends the run (nothing: it does not)."""
    off = row["not_held"]
    reasons = [f"this machine did not hold its {' nor its '.join(off)} ("
               + "; ".join(f"{phase}: {why}" for phase, why in off.items())
               + "): the times there are its wait for its cores, not the store's (a rank of a "
               "job has cores of its own)"] if off else []
    if row["hang_verdict_s"] is None:
        reasons.append(f"the hang's probes did not finish within {budget_s:g} s on this machine, "
                       "or a store call in them timed out")
    if row["nodes"] > 1 and row["agreed_s"] is None:
        reasons.append(f"the agreement did not finish within {budget_s:g} s, or a store call in "
                       "it timed out")
    return reasons
AGREED_TARGET_S = 2.0
"""The issue's target for an agreed membership after a lost node."""
VERDICT_MARGIN_S = 2.0
"""A hang's verdict is due within ``--hang-timeout`` and this."""
BUSIEST_TARGET = 0.25
"""The store's busiest second, steady or in a fault, under this share of its capacity."""


def targets(row: dict[str, Any], hang_timeout: float, cap: float) -> dict[str, bool | None]:
    """Which of the targets a size's row meets; None where it was not measured, or where a
    phase this machine did not hold (:func:`not_held`) leaves it open. Such a phase still
    tells one way: its ranks, queued for the cores, were late and spread their operations
    out. A time met there is met (ranks with cores of their own are sooner); a busiest second
    over its target is over it (they bunch their operations more)."""
    off = row["not_held"]

    def met(ok: bool, *phases: str, held_says: bool) -> bool | None:
        return ok if ok is held_says or not any(phase in off for phase in phases) else None

    return {
        "busiest second steady": met(row["busiest_second_steady"] < BUSIEST_TARGET * cap,
                                     "steady", held_says=False),
        "busiest second in a fault": met(row["busiest_second_fault"] < BUSIEST_TARGET * cap,
                                         "hang", "lost node", held_says=False),
        "hang verdict": None if row["hang_verdict_s"] is None
        else met(row["hang_verdict_s"] <= hang_timeout + VERDICT_MARGIN_S, "hang",
                 held_says=True),
        "agreed membership": None if row["agreed_s"] is None
        else met(row["agreed_s"] <= AGREED_TARGET_S, "lost node", held_says=True),
    }


def verdicts(rows: list[dict[str, Any]], hang_timeout: float) -> str:
    """The targets each size met, in a line, and the largest size that this machine held and
    that met them all."""
    parts, largest = [], None
    for r in rows:
        missed = [name for name, ok in r["targets"].items() if ok is False]
        part = f"{r['ranks']} ranks " + (f"missed: {', '.join(missed)}" if missed
                                         else "met every one judged")
        unjudged = [name for name, ok in r["targets"].items() if ok is None]
        if r["not_held"] and unjudged:
            part += (f" ({', '.join(unjudged)}: not judged, its {' and '.join(r['not_held'])} "
                     "not held here)")
        parts.append(part)
        largest = r["ranks"] if not missed and not r["not_held"] else largest
    return (f"Targets (the busiest second under {BUSIEST_TARGET:.0%} of the capacity, steady and "
            f"in a fault; a hang's verdict within {hang_timeout + VERDICT_MARGIN_S:g} s; an "
            f"agreed membership within {AGREED_TARGET_S:g} s): " + "; ".join(parts)
            + (f". The largest size this machine held, and that met them all: {largest} ranks."
               if largest else "."))


def exponent(rows: list[dict[str, Any]], lo: int, hi: int,
             field: str = "steady_ops_s") -> float | None:
    """The growth exponent of the steady operations a second (``field``: as counted, or as the
    model says) from ``lo`` to ``hi`` ranks."""
    by = {r["ranks"]: r[field] for r in rows}
    if lo not in by or hi not in by or by[lo] <= 0:
        return None
    return math.log(by[hi] / by[lo]) / math.log(hi / lo)
