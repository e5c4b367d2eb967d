"""A model of the backward kernel's tail: one CTA per SM, CTAs taken in launch order by the first
free SM, a CTA's time = the query tiles it visits. Compares one launch with the dQ chunks' several
launches (each drains the GPU), for both grid orders, at B=2, T=S=8192, N=K=16 (64 key tiles).

  python scripts/model_bwd_grid_tail.py [sms]
"""
import heapq
import sys


def makespan(works, sms):
  free = [0] * sms
  end = 0
  for w in works:
    t = heapq.heappop(free) + w
    end = max(end, t)
    heapq.heappush(free, t)
  return end


def launch(heads, tiles, causal, tiles_slowest):
  work = lambda j: tiles - j if causal else tiles  # causal: key tile j visits query tiles j..
  if tiles_slowest:
    return [work(j) for j in range(tiles) for _ in range(heads)]
  return [work(j) for _ in range(heads) for j in range(tiles)]


def main():
  sms = int(sys.argv[1]) if len(sys.argv) > 1 else 132
  heads, tiles = 2 * 16, 64  # (batch, kv head) pairs, key tiles
  for causal in (False, True):
    for slowest in (False, True):
      one = makespan(launch(heads, tiles, causal, slowest), sms)
      row = [f"causal={causal!s:5} key tile {'slowest' if slowest else 'fastest'}: one launch {one}"]
      for chunks in (2, 4):
        t = chunks * makespan(launch(heads // chunks, tiles, causal, slowest), sms)
        row.append(f"{chunks} chunks {t} ({t / one:.3f}x)")
      print("; ".join(row))


if __name__ == "__main__":
  main()
