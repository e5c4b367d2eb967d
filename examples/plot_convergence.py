"""Compare training runs of examples/train_lm.py: loss curves (PNG) and a text summary.

  python examples/plot_convergence.py fa4.json cudnn.json --out convergence.png

The text summary (always printed; matplotlib is needed only for the PNG) gives, per run, the
final held-out loss, the mean step time and the train loss (averaged over the last 10% of
steps), and for two runs the differences between them.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np


def _smooth(y, frac=0.02):
  w = max(1, int(len(y) * frac))
  if w == 1:
    return np.asarray(y)
  c = np.cumsum(np.insert(np.asarray(y, np.float64), 0, 0.0))
  out = (c[w:] - c[:-w]) / w
  return np.concatenate([np.asarray(y[:w - 1]), out])


def summary(logs, names) -> str:
  rows = []
  for log, name in zip(logs, names):
    losses = [s["loss"] for s in log["steps"]]
    tail = losses[-max(1, len(losses) // 10):]
    st = log.get("mean_step_time")
    rows.append((name, len(losses), float(np.mean(tail)) if tail else float("nan"),
                 log.get("final_heldout_loss", float("nan")), st))
  lines = [f"{'run':<16}{'steps':>7}{'train(last10%)':>16}{'held-out':>10}{'ms/step':>10}"]
  for name, n, tr, ho, st in rows:
    lines.append(f"{name:<16}{n:>7}{tr:>16.4f}{ho:>10.4f}"
                 f"{(st * 1e3 if st else float('nan')):>10.1f}")
  if len(rows) == 2:
    (a, _, tra, hoa, _), (b, _, trb, hob, _) = rows
    lines.append(f"{a} - {b}: train {tra - trb:+.4f}, held-out {hoa - hob:+.4f} nats/byte")
  return "\n".join(lines)


def plot(logs, names, out: str):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(f"[plot_convergence] matplotlib is not installed: no PNG written to {out}")
    return False
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for log, name in zip(logs, names):
    steps = [s["step"] for s in log["steps"]]
    loss = [s["loss"] for s in log["steps"]]
    wall = [s.get("wall", 0.0) for s in log["steps"]]
    line, = axes[0].plot(steps, _smooth(loss), label=f"{name} train", lw=1)
    ev = log.get("evals", [])
    if ev:
      axes[0].plot([e["step"] for e in ev], [e["loss"] for e in ev], "o--",
                   color=line.get_color(), label=f"{name} held-out", ms=4)
    axes[1].plot(wall, _smooth(loss), label=name, lw=1)
  axes[0].set_xlabel("step")
  axes[1].set_xlabel("wall time (s)")
  for ax in axes:
    ax.set_ylabel("loss (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=120)
  plt.close(fig)
  print(f"[plot_convergence] wrote {out}")
  return True


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("logs", nargs="+", help="JSON logs written by train_lm.py --log")
  ap.add_argument("--names", nargs="*", default=None)
  ap.add_argument("--out", default=None, help="PNG path")
  a = ap.parse_args(argv)
  logs = []
  for p in a.logs:
    with open(p) as fh:
      logs.append(json.load(fh))
  names = a.names or [lg["config"].get("attention", os.path.basename(p))
                      for lg, p in zip(logs, a.logs)]
  print(summary(logs, names))
  if a.out:
    plot(logs, names, a.out)


if __name__ == "__main__":
  main()
