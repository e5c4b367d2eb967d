"""Summarise `ncu --page source --csv --print-source sass`: the instructions with the most warp-stall
samples, each with its non-zero stall reasons, plus the totals per reason.

  python scripts/ncu_top_stalls.py SRC.csv [N]
"""
import csv
import sys


def num(x):
  try:
    return float(str(x).replace(",", ""))
  except ValueError:
    return 0.0


def main():
  path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40
  with open(path, newline="") as fh:
    lines = [ln for ln in fh if ln.strip()]
  start = next(i for i, ln in enumerate(lines) if "Source" in ln and "Address" in ln)
  rows = list(csv.DictReader(lines[start:]))
  cols = list(rows[0].keys())
  total_col = next((c for c in cols if c.startswith("Warp Stall Sampling (All")), None)
  reason_cols = [c for c in cols if c.lower().startswith("stall_") or "stall" in c.lower() and c != total_col
                 and "Sampling" not in c]
  if total_col is None:
    print("columns:", cols)
    return
  total = sum(num(r[total_col]) for r in rows) or 1.0
  print(f"{len(rows)} SASS instructions, {total:.0f} stall samples; reason columns: {len(reason_cols)}")
  sums = {c: sum(num(r[c]) for r in rows) for c in reason_cols}
  print("by reason:", ", ".join(f"{c}={v / total:.1%}" for c, v in sorted(sums.items(), key=lambda kv: -kv[1]) if v > 0))
  for r in sorted(rows, key=lambda r: -num(r[total_col]))[:n]:
    why = ", ".join(f"{c}={num(r[c]):.0f}" for c in reason_cols if num(r[c]) > 0)
    print(f"{num(r[total_col]) / total:6.2%} {r.get('Address', '')} {r['Source'][:70]:70s} {why[:150]}")


if __name__ == "__main__":
  main()
