"""`folio bench latency --profile`: where one engine step's time goes, phase by phase.

The phases and clocks are folio.step_timer's. The report keeps only the steps in which every request of the
batch decodes one token (``--batch-size`` requests, as many tokens): the steady state the overhead target is
about, without the prefill step or the ragged tail where requests finish. With the no-op model
(``model_impl="noop"``) the forward is nearly free, so the table is the engine's own cost; with the real model
the same table shows that overhead next to the model's time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from folio.step_timer import FORWARD, PHASES, PREPARE_INPUTS, SCHEDULE, StepTiming

# Engine overhead target: scheduler + input preparation of a 64-request decode step, in CPU ms.
OVERHEAD_TARGET_MS = 2.0
TOTAL = "step total"
OVERHEAD = "scheduler + input preparation"


def _stats_ms(values_s: list[float]) -> dict[str, float]:
    arr = np.asarray(values_s, dtype=np.float64) * 1000
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


def summarize_steps(steps: list[StepTiming], batch_size: int) -> dict[str, Any]:
    """Per-phase mean/p50/p99 (ms, both clocks) over the steps where all ``batch_size`` requests decode.

    Raises ValueError if there is no such step (an output length of 1, or a batch larger than max_num_seqs).
    """
    chosen = [s for s in steps if s.is_pure_decode and s.num_reqs == batch_size]
    if not chosen:
        raise ValueError(
            f"no step had all {batch_size} requests decoding: use --output-len >= 2 and --max-num-seqs >= --batch-size"
        )
    phases: dict[str, Any] = {}
    for phase in (*PHASES, TOTAL, OVERHEAD):
        members = PHASES if phase == TOTAL else (SCHEDULE, PREPARE_INPUTS) if phase == OVERHEAD else (phase,)
        phases[phase] = {
            "cpu_ms": _stats_ms([sum(s.cpu_s.get(p, 0.0) for p in members) for s in chosen]),
            "wall_ms": _stats_ms([sum(s.wall_s.get(p, 0.0) for p in members) for s in chosen]),
        }
    overhead_ms = phases[OVERHEAD]["cpu_ms"]["mean"]
    return {
        "batch_size": batch_size,
        "num_steps": len(chosen),
        "num_steps_total": len(steps),
        "phases": phases,
        "scheduler_plus_input_preparation_cpu_ms": overhead_ms,
        "target_ms": OVERHEAD_TARGET_MS,
        "meets_target": overhead_ms < OVERHEAD_TARGET_MS,
    }


def format_profile(summary: dict[str, Any], title: str, noop: bool) -> str:
    """The one-screen table: a row per phase, CPU and wall mean/p50/p99 in ms, then the overhead line."""
    width = 78
    lines = ["{s:{c}^{w}}".format(s=f" {title} ", c="=", w=width)]
    lines.append(
        f"{summary['num_steps']} steps with all {summary['batch_size']} requests decoding "
        f"(of {summary['num_steps_total']} timed steps)"
    )
    lines.append(f"{'':30}{'CPU ms (engine thread)':^24}{'wall ms':^24}")
    lines.append(f"{'phase':<30}" + "".join(f"{s:>8}" for s in ("mean", "p50", "p99") * 2))
    for phase in (*PHASES, TOTAL):
        label = f"{phase} (no-op)" if noop and phase == FORWARD else phase
        if phase == TOTAL:
            lines.append("-" * width)
        stats = summary["phases"][phase]
        cells = [stats[clock][s] for clock in ("cpu_ms", "wall_ms") for s in ("mean", "p50", "p99")]
        lines.append(f"{label:<30}" + "".join(f"{v:>8.3f}" for v in cells))
    lines.append("=" * width)
    overhead = summary["phases"][OVERHEAD]["cpu_ms"]
    verdict = "met" if summary["meets_target"] else "NOT met"
    lines.append(
        f"{OVERHEAD}: {overhead['mean']:.3f} ms CPU per step (p50 {overhead['p50']:.3f}, p99 {overhead['p99']:.3f}; "
        f"target < {summary['target_ms']:g} ms: {verdict})"
    )
    return "\n".join(lines)


def summarize_fused_phases(records: list[tuple[int, int, list[float]]], batch_size: int) -> dict[str, float]:
    """Mean ms per step of each fused-decoder phase (folio.model.cpu_fused.PHASES) over the forwards in which
    all ``batch_size`` requests decode (no prefill), the steps the step table keeps. Empty if there were none."""
    from folio.model.cpu_fused import PHASES

    chosen = [seconds for num_rows, num_segs, seconds in records if num_rows == batch_size and num_segs == 0]
    if not chosen:
        return {}
    means = np.asarray(chosen, dtype=np.float64).mean(axis=0) * 1000
    return {name: float(ms) for name, ms in zip(PHASES, means, strict=True)}


def format_fused_phases(phases_ms: dict[str, float], batch_size: int) -> str:
    """The fused decoder's phases (wall ms per decode step of the whole batch, and each phase's share)."""
    if not phases_ms:
        return "fused decoder phases: no step with the whole batch decoding"
    total = sum(phases_ms.values())
    lines = [f"Fused decoder phases, all layers, per step of {batch_size} decodes (wall ms)"]
    for name, ms in sorted(phases_ms.items(), key=lambda item: -item[1]):
        lines.append(f"  {name:<20} {ms:8.3f}  {100 * ms / total:5.1f}%")
    lines.append(f"  {'all phases':<20} {total:8.3f}")
    return "\n".join(lines)
