"""PNG charts of a run's figures (matplotlib, from the optional ``bench`` extra).

``summary.png`` puts every target on one scale (the measured value over its bound, so
1.0 is the line to cross); ``<scenario>.png`` shows each scenario's own figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PASS_COLOR = "#2e7d32"
FAIL_COLOR = "#c62828"
PLAIN_COLOR = "#546e7a"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("charts need matplotlib: pip install 'taskboard[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(data: dict[str, Any], directory: Path) -> list[Path]:
    """Draw the charts for ``data`` (a results.json) into ``directory``; return the paths."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    paths = [_summary(plt, data, directory / "summary.png")]
    for scenario in data["scenarios"]:
        if scenario["figures"]:
            paths.append(_scenario(plt, scenario, directory / f"{scenario['name']}.png"))
    return paths


def _bound(figure: dict[str, Any]) -> tuple[str, float]:
    op, _, bound = figure["target"].partition(" ")
    return op, float(bound)


def _summary(plt: Any, data: dict[str, Any], path: Path) -> Path:
    rows = []
    for scenario in data["scenarios"]:
        for figure in scenario["figures"]:
            if figure["target"]:
                op, bound = _bound(figure)
                # Higher is better for ">=" targets; for "<" ones, show bound / value so
                # that right of 1.0 is always the good side.
                score = (
                    figure["value"] / bound
                    if op.startswith(">")
                    else bound / max(figure["value"], 1e-9)
                )
                rows.append((f"{scenario['name']}: {figure['name']}", score, figure["passed"]))
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2), dpi=90)
    labels = [row[0] for row in rows][::-1]
    scores = [min(row[1], 5) for row in rows][::-1]
    colors = [PASS_COLOR if row[2] else FAIL_COLOR for row in rows][::-1]
    ax.barh(labels, scores, color=colors)
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("measured against target (1.0 = target; right is better; capped at 5)")
    run = "quick" if data["quick"] else "full"
    ax.set_title(f"taskboard benchmark ({run} run, {data['machine']['cpus']} CPUs)", fontsize=10)
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _scenario(plt: Any, scenario: dict[str, Any], path: Path) -> Path:
    groups: dict[str, list[dict[str, Any]]] = {}
    for figure in scenario["figures"]:
        groups.setdefault(figure["unit"] or "count", []).append(figure)
    fig, axes = plt.subplots(
        len(groups),
        1,
        figsize=(7, sum(0.4 * len(g) + 0.7 for g in groups.values()) + 0.5),
        dpi=90,
        squeeze=False,
    )
    for ax, (unit, figures) in zip(axes[:, 0], groups.items(), strict=True):
        labels = [f["name"].strip() for f in figures][::-1]
        values = [f["value"] for f in figures][::-1]
        colors = [
            {True: PASS_COLOR, False: FAIL_COLOR, None: PLAIN_COLOR}[f["passed"]] for f in figures
        ][::-1]
        ax.barh(labels, values, color=colors)
        for index, value in enumerate(values):
            ax.text(
                value,
                index,
                f" {value:,.0f}" if value >= 10 or value == int(value) else f" {value:,.2f}",
                va="center",
                fontsize=8,
            )
        for figure in figures:
            if figure["target"]:
                ax.axvline(_bound(figure)[1], color="black", linestyle="--", linewidth=1)
        ax.set_xlabel(unit)
        ax.tick_params(axis="y", labelsize=8)
        ax.margins(x=0.2)
    axes[0, 0].set_title(scenario["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
