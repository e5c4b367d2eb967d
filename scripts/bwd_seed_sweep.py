"""How often does one case of tests/test_cuda_backward.py meet its accuracy contract? Runs the case
(index into tb.CASES) on n consecutive input seeds and prints, per seed, dQ / dK / dV as the
kernel's error over the recipe's and over the contract's bound (> 1 fails). GPU only.

  python scripts/bwd_seed_sweep.py CASE_INDEX N_SEEDS [FIRST_SEED]

A failing seed s of case i replays with `JAX_FA4_TEST_SEED=$((s - i)) python scripts/diag_bwd_delta.py i`
(which separates the backward kernel from the forward's O / lse it is given).
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import test_cuda_backward as tb  # noqa: E402
from contract import contract_bound, rel_err  # noqa: E402


def main():
  idx, n = int(sys.argv[1]), int(sys.argv[2])
  first = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
  case = tb.CASES[idx]
  print(f"case {idx} {tb._ids(case)}, seeds {first}..{first + n - 1}")
  worst = {}
  fails = []
  for seed in range(first, first + n):
    r = tb._run_case(case, seed)
    row = []
    for i, name in enumerate(("dq", "dk", "dv")):
      e, er, eb = (rel_err(x, r["truth"][i]) for x in (r["grads"][i], r["rgrads"][i], r["bf16"][i]))
      q = e / contract_bound(er, eb)
      worst[name] = max(worst.get(name, 0.0), q)
      row.append(f"{name} x{e / max(er, 1e-30):.3f} (bound use {q:.3f}, err {e:.3e})")
      if q > 1:
        fails.append((seed, name, q))
    print(f"seed {seed}: " + " | ".join(row), flush=True)
  print("worst bound use: " + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()))
  print(f"{len(fails)} misses in {n} seeds: {fails}")


if __name__ == "__main__":
  main()
