"""CPU model of the dQ-warpgroup backward's synchronisation (csrc/cuda/bwd_sm90_kernel.cuh,
`dq_warpgroup` and the consumers' `kDQWG` branches; opt-in, JAX_FA4_SM90_BWD_DQWG=1).

The kernel has not run on a GPU yet. What can be checked without one is its protocol: who waits on
which mbarrier phase, with which parity, before touching which shared buffer. This test runs that
protocol, transcribed from the kernel (the parities below are the kernel's expressions), under many
random schedules of its agents and asserts, at every step, what the kernel relies on:
  * warpgroup 0 reads a dS^T buffer only when all 8 consumer warps have stored this tile's part of
    it, and the consumers have written the dequantized K tile (the first dQ reads it);
  * a consumer warp overwrites a dS^T buffer only after warpgroup 0 has finished reading its
    previous tile (two tiles back), never while it reads;
  * the producer duty (warpgroup 0's thread 0) loads a stage only when every consumer warp has
    released the tile it held, and a consumer reads a stage only when it holds its own tile;
  * the scale-byte words a warp reads after the pair barrier are its partner's words of this tile
    (two exchange buffers, one per tile parity);
  * every mbarrier wait returns for the phase the kernel means (a parity matches every second phase,
    so a wait that is one phase early or late would pass on the hardware for the wrong phase);
  * the run ends: no schedule deadlocks.
The mbarrier model: `count` arrivals complete a phase; `try_wait.parity(P)` succeeds when the
current phase's parity is not P. Thread-granular arrivals are modelled per warp (the kernel's
every-thread arrivals make no difference to phases). Warpgroup 0's internal order (its named
barrier 7, the writer's bulk waits) is sequential here. Mutations of the protocol (a parity off by
one, a wait removed, one exchange buffer) must be caught, so the model is known to have teeth.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

ST = 2        # BwdTileConfig<H <= 128>::kStages
WARPS = 8     # two consumer warpgroups x 4 warps


class Violation(AssertionError):
  pass


def check(cond, msg):
  if not cond:
    raise Violation(msg)


class MBarrier:
  def __init__(self, name, count):
    self.name, self.count, self.pending, self.phase = name, count, count, 0

  def arrive(self):
    self.pending -= 1
    if self.pending == 0:
      self.phase += 1
      self.pending = self.count


def wait(bar, parity, k):
  """mbar_wait(bar, parity), meant for completion number k (0-based) of bar."""
  yield lambda: (bar.phase & 1) != parity
  check(bar.phase == k + 1, f"{bar.name}: a wait for completion {k} returned at phase {bar.phase}")


class PairBarrier:
  """bar.sync id, 64: the two warps of a 32-key block."""

  def __init__(self):
    self.arrived, self.gen = 0, 0

  def sync(self):
    g = self.gen
    self.arrived += 1
    if self.arrived == 2:
      self.arrived, self.gen = 0, self.gen + 1
    yield lambda: self.gen != g


@dataclasses.dataclass(frozen=True)
class Protocol:
  """The kernel's choices; a mutation flips one."""
  ds_empty_wait: bool = True       # consumers wait for the dS^T buffer to be free (it >= 2)
  ds_empty_parity_shift: int = 0   # 0: the kernel's ((it >> 1) - 1) & 1
  ds_full_parity_shift: int = 0    # 0: the kernel's (it >> 1) & 1
  load_parity_flip: int = 1        # 1: the kernel's (((it + ST) / ST) & 1) ^ 1
  xchg_buffers: int = 2            # exchange buffers, one per tile parity


class State:
  def __init__(self, n_iters, passes, proto, rng):
    self.n, self.passes, self.proto, self.rng = n_iters, passes, proto, rng
    self.full = [MBarrier(f"full[{s}]", 1) for s in range(ST)]
    self.empty = [MBarrier(f"empty[{s}]", WARPS) for s in range(ST)]
    self.ds_full = [MBarrier(f"ds_full[{b}]", WARPS) for b in range(2)]
    self.ds_empty = [MBarrier(f"ds_empty[{b}]", 1) for b in range(2)]
    self.stage = [None] * ST             # the tile whose Q / dO / lse / delta a stage holds
    self.stage_users = [set() for _ in range(ST)]
    self.dsbuf = [[None] * WARPS for _ in range(2)]  # per buffer, the tile each warp's part holds
    self.ds_read_upto = [-1, -1]         # per buffer, the last tile warpgroup 0 finished reading
    self.ds_reading = [False, False]
    self.k_written = 0                   # consumer warps that dequantized their K rows
    self.xchg = [[None] * WARPS for _ in range(proto.xchg_buffers)]
    self.pairs = [PairBarrier() for _ in range(WARPS // 2)]
    self.k_barrier = MBarrier("bar 1 (K / V dequant)", WARPS)  # bar.sync 1, 256 once, as a barrier
    self.agents = []

  def spawn(self, gen):
    self.agents.append([gen, None])


def load(st, L):
  """The TMA loads of query tile L into stage L % ST, completing on full[L % ST] some time later."""
  s = L % ST
  check(not st.stage_users[s], f"tile {L} loaded into stage {s} while warps {st.stage_users[s]} read tile {st.stage[s]}")
  st.stage[s] = None  # in flight
  for _ in range(int(st.rng.integers(0, 4))):
    yield None
  st.stage[s] = L
  st.full[s].arrive()


def dq_warpgroup(st):
  p = st.proto
  for L in range(min(ST, st.n)):
    st.spawn(load(st, L))
  for it in range(st.n):
    b = it & 1
    yield from wait(st.ds_full[b], ((it >> 1) + p.ds_full_parity_shift) & 1, it >> 1)
    check(st.k_written == WARPS, "dQ read K before every consumer warp dequantized it")
    check(all(x == it for x in st.dsbuf[b]), f"dQ of tile {it} read dS^T parts {st.dsbuf[b]}")
    st.ds_reading[b] = True
    for pss in range(st.passes):  # each pass's wgmmas read the buffer until their wait
      for _ in range(int(st.rng.integers(1, 3))):
        yield None
        check(all(x == it for x in st.dsbuf[b]), f"dS^T buffer {b} overwritten while dQ of tile {it} read it")
      if pss == st.passes - 1:
        st.ds_reading[b] = False
        st.ds_read_upto[b] = it
        st.ds_empty[b].arrive()
      if pss == 0 and it + ST < st.n:  # producer duty, after the first pass's wait
        L = it + ST
        yield from wait(st.empty[it % ST], ((L // ST) & 1) ^ p.load_parity_flip, L // ST - 1)
        st.spawn(load(st, L))
      yield None  # this pass's dQ stores (and, after the last, the writer's reduce-add)


def consumer_warp(st, w):
  p = st.proto
  st.k_written += 1  # dequant_kv_tile, then fence + bar.sync 1, 256
  st.k_barrier.arrive()
  yield lambda: st.k_barrier.phase >= 1
  for it in range(st.n):
    s, b = it % ST, it & 1
    yield from wait(st.full[s], (it // ST) & 1, it // ST)
    check(st.stage[s] == it, f"warp {w} at tile {it} found stage {s} holding {st.stage[s]}")
    st.stage_users[s].add(w)
    for _ in range(int(st.rng.integers(0, 3))):  # S, dP, softmax, dS, dV, dK issue, T-blocks
      yield None
    xb = it % p.xchg_buffers
    st.xchg[xb][w] = it
    yield from st.pairs[w // 2].sync()
    yield None  # the words are read after the barrier, not at it
    check(st.xchg[xb][w ^ 1] == it, f"warp {w} at tile {it} read its partner's words of tile {st.xchg[xb][w ^ 1]}")
    if p.ds_empty_wait and it >= 2:
      yield from wait(st.ds_empty[b], (((it >> 1) - 1) + p.ds_empty_parity_shift) & 1, (it >> 1) - 1)
    check(not st.ds_reading[b], f"warp {w} wrote dS^T buffer {b} while dQ read it")
    check(st.ds_read_upto[b] >= it - 2, f"warp {w} overwrote dS^T buffer {b} before dQ read tile {it - 2}")
    st.dsbuf[b][w] = it
    st.ds_full[b].arrive()
    yield None  # wgmma_wait<0>: dV, dK done
    st.stage_users[s].discard(w)
    st.empty[s].arrive()


def run(n_iters, passes, proto, seed, max_steps=200000):
  """One random schedule; passes = HV / kDQWGPassN (1 at H = 64, 4 at H = 128)."""
  rng = np.random.default_rng(seed)
  st = State(n_iters, passes, proto, rng)
  st.spawn(dq_warpgroup(st))
  for w in range(WARPS):
    st.spawn(consumer_warp(st, w))
  speed = {}  # a random speed per agent: skewed schedules let one warp run far ahead
  for _ in range(max_steps):
    live = [a for a in st.agents if a[0] is not None]
    if not live:
      return
    ready = [a for a in live if a[1] is None or a[1]()]
    if not ready:
      raise Violation(f"deadlock with {len(live)} agents waiting")
    weights = np.array([speed.setdefault(id(a[0]), rng.uniform(0.05, 1.0)) for a in ready])
    a = ready[rng.choice(len(ready), p=weights / weights.sum())]
    try:
      a[1] = next(a[0])
    except StopIteration:
      a[0] = None
  raise Violation("no end after max_steps")


@pytest.mark.parametrize("passes", [1, 4])
@pytest.mark.parametrize("n_iters", [1, 2, 3, 4, 7, 12])
def test_protocol_holds_under_random_schedules(n_iters, passes):
  for seed in range(100):
    run(n_iters, passes, Protocol(), seed)


@pytest.mark.parametrize("mutation", [
    dict(ds_empty_wait=False),
    dict(ds_empty_parity_shift=1),
    dict(ds_full_parity_shift=1),
    dict(load_parity_flip=0),
    dict(xchg_buffers=1),
], ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_protocol_mutations_are_caught(mutation):
  """With 4 passes (H = 128): the tile it + 2 that lets a consumer overwrite tile it's dS^T buffer is
  loaded after dQ's first pass, while the other passes still read it, so the ds_empty wait is needed
  there. (With one pass, H = 64, that load comes after the only read, and the stage ring alone
  orders the overwrite; the kernel waits anyway.)"""
  proto = Protocol(**mutation)
  caught = 0
  for seed in range(300):
    try:
      run(7, 4, proto, seed)
    except Violation:
      caught += 1
  assert caught > 0, f"{mutation}: no schedule of 300 found the broken protocol"
