"""A PNG of the reward curve, written next to the TensorBoard logs at the end of a run."""
from __future__ import annotations

from pathlib import Path


def plot_reward_curve(history: list[dict], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, style in (("critic/score/mean", "train reward (mean)", "-"), ("val/score", "validation score", "o--")):
        points = [(h["step"], h[key]) for h in history if key in h]
        if points:
            ax.plot(*zip(*points), style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    ax.set_title("megarl: reward curve")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
