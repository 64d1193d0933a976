"""Look at plans: a text grid, an SVG timeline and a Chrome/Perfetto trace (no plotting dependencies)."""
from __future__ import annotations

import json
from xml.sax.saxutils import escape

from tabulate import tabulate

COLORS = {"F": "#4e79a7", "B": "#e15759", "I": "#f28e2b", "W": "#59a14f"}


def format_grid(actions: dict, stage_to_rank=None, compute_only: bool = True) -> str:
    """A table with one column per rank and one row per step (position in that rank's list).

    ``compute_only`` drops comm actions. ``stage_to_rank`` (optional) adds each rank's stages to its header.
    """
    ranks = sorted(actions)
    cols = []
    for r in ranks:
        acts = [a for a in actions[r] if not (compute_only and a.is_comm)]
        cols.append([str(a) for a in acts])
    depth = max((len(c) for c in cols), default=0)
    rows = [[i] + [c[i] if i < len(c) else "" for c in cols] for i in range(depth)]
    headers = ["step"]
    for r in ranks:
        if stage_to_rank is not None:
            stages = [s for s, rr in enumerate(stage_to_rank) if rr == r]
            headers.append(f"rank {r} (stages {','.join(map(str, stages))})")
        else:
            headers.append(f"rank {r}")
    return tabulate(rows, headers=headers, tablefmt="simple")


def write_svg(sim, path, unit: float = 24.0) -> None:
    """Timeline of a :class:`~tracepp.codegen.simulate.SimResult`: one lane per rank, one box per compute
    action colored by kind and labeled ``stage/mb``, with a time axis. Writes a standalone SVG file."""
    lane_h, left, top = 28.0, 70.0, 30.0
    makespan = sim.makespan or 1.0
    scale = unit if makespan * unit <= 4000 else 4000.0 / makespan
    ranks = sorted(sim.timeline)
    width = left + makespan * scale + 20
    height = top + lane_h * len(ranks) + 50
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="monospace" font-size="10">',
        f'<rect x="0" y="0" width="{width:.0f}" height="{height:.0f}" fill="white"/>',
        f'<text x="{left}" y="16" font-size="12">makespan {makespan:g}, bubble '
        f'{sim.bubble_overall:.1%}</text>',
    ]
    for lane, r in enumerate(ranks):
        y = top + lane * lane_h
        parts.append(f'<text x="6" y="{y + lane_h / 2 + 4:.1f}">rank {r}</text>')
        parts.append(f'<rect x="{left}" y="{y + 2:.1f}" width="{makespan * scale:.1f}" height="{lane_h - 4:.1f}" '
                     f'fill="#f4f4f4"/>')
        for action, start, end in sim.timeline[r]:
            x, w = left + start * scale, max((end - start) * scale, 0.5)
            color = COLORS.get(action.kind, "#999999")
            label = escape(f"{action.kind}{action.stage}/{action.mb}")
            parts.append(
                f'<g><title>{escape(str(action))} [{start:g}, {end:g}]</title>'
                f'<rect x="{x:.1f}" y="{y + 2:.1f}" width="{w:.1f}" height="{lane_h - 4:.1f}" fill="{color}" '
                f'stroke="white" stroke-width="0.5"/>')
            if w >= 22:
                parts.append(f'<text x="{x + w / 2:.1f}" y="{y + lane_h / 2 + 3:.1f}" fill="white" '
                             f'text-anchor="middle">{label}</text>')
            parts.append("</g>")
    axis_y = top + lane_h * len(ranks) + 8
    parts.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + makespan * scale:.1f}" y2="{axis_y}" '
                 f'stroke="black"/>')
    step = _tick_step(makespan)
    t = 0.0
    while t <= makespan + 1e-9:
        x = left + t * scale
        parts.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="black"/>')
        parts.append(f'<text x="{x:.1f}" y="{axis_y + 15}" text-anchor="middle">{t:g}</text>')
        t += step
    legend_x = left
    for kind, color in COLORS.items():
        parts.append(f'<rect x="{legend_x}" y="{axis_y + 22}" width="10" height="10" fill="{color}"/>')
        parts.append(f'<text x="{legend_x + 14}" y="{axis_y + 31}">{kind}</text>')
        legend_x += 40
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def _tick_step(span: float) -> float:
    for step in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000):
        if span / step <= 20:
            return float(step)
    return span / 10


def write_chrome_trace(sim, path, time_unit_us: float = 1000.0) -> None:
    """Chrome trace JSON (``{"traceEvents": [...]}``): one "X" event per compute action, pid = rank.

    Simulated time units are scaled by ``time_unit_us`` microseconds (default: 1 unit = 1 ms).
    Opens in Perfetto (ui.perfetto.dev) or chrome://tracing.
    """
    events = []
    for r in sorted(sim.timeline):
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        for action, start, end in sim.timeline[r]:
            events.append({
                "name": str(action), "cat": action.kind, "ph": "X", "pid": r, "tid": 0,
                "ts": start * time_unit_us, "dur": (end - start) * time_unit_us,
                "args": {"stage": action.stage, "microbatch": action.mb, "kind": action.kind},
            })
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
