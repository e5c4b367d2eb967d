"""CPU model of the Hopper backward's K / V tiles (csrc/cuda/bwd_sm90_kernel.cuh, dequant_kv_tile).

The kernel used to TMA-load K and V as bf16 copies (exact_rows' output) into 128B-swizzled shared
memory; it now reads them as MX (e4m3 bytes + E8M0 scale bytes, blocked along H) and writes the
bf16 values itself. Its results are bitwise those of the old path only if every byte of both tiles
is what the TMA load wrote. This test models both writers in numpy and compares the shared-memory
images byte for byte:
  * TMA: tensor map over the bf16 copy as bytes [B, S, Kh, 2H], box 128 bytes x BN rows, one load
    per 64-column atom to tile + atom * BN * 128 (1024-byte aligned), SWIZZLE_128B (16-byte chunk
    bits [4:6] of the offset XORed with bits [7:9]), rows past S filled with zeros (OOB_FILL_NONE);
  * kernel: the thread mapping and address formula of dequant_kv_tile, transcribed line by line.
Values come from one model of dequant8_bf16 (mx_math.cuh) on both sides, since both paths run
that same device function (exact_rows_kernel for the bf16 copy, dequant_kv_tile now); what this
test checks is which bytes land where, which rows are zero, that every byte of a tile is written
exactly once (no gaps, no two threads on one chunk), and that each quarter warp's 16-byte stores
hit 8 distinct bank groups.
"""
import ml_dtypes
import numpy as np
import pytest

BN = 128  # BwdTileConfig::kBlockN
THREADS = 256  # the two consumer warpgroups
E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16


def _dequant_bf16(data, scale_bytes):
  """dequant8_bf16 elementwise: e4m3 * 2^(byte - 127) in fp32 as two power-of-two factors (floor
  split; numpy keeps fp32 subnormals as the device's non-ftz __fmul_rn does), NaN for byte 255,
  then bf16 round-to-nearest-even. Returns the bf16 bit patterns (uint16)."""
  x = data.view(E4M3).astype(np.float32)
  e = scale_bytes.astype(np.int32) - 127
  e1 = np.floor_divide(e, 2)
  e2 = e - e1
  f1 = ((e1 + 127) << 23).astype(np.uint32).view(np.float32)
  f2 = ((e2 + 127) << 23).astype(np.uint32).view(np.float32)
  with np.errstate(over="ignore", invalid="ignore"):
    y = (x * f1) * f2
  y = np.where(scale_bytes == 255, np.float32(np.nan), y).astype(np.float32)
  return y.astype(BF16).view(np.uint16)


def _bf16_copy(x8, xs, H):
  """exact_rows' output [B, S, Kh, H] bf16 bits: scale byte of element e is xs[..., e // 32]."""
  return _dequant_bf16(x8, np.repeat(xs, 32, axis=-1)[..., :H])


def _tma_tile(xbf, b, kh, k0, H):
  """The shared-memory image the producer's TMA loads of the bf16 copy wrote (bytes)."""
  S = xbf.shape[1]
  rowbytes = xbf[b, :, kh, :].copy().view(np.uint8).reshape(S, 2 * H)  # little-endian bf16
  atoms = 2 * H // 128
  img = np.full(atoms * BN * 128, 0xAA, np.uint8)  # poison: every byte must be written
  for c in range(atoms):
    box = np.zeros((BN, 128), np.uint8)  # OOB rows (k0 + y >= S) stay zero
    n = min(BN, S - k0)
    box[:n] = rowbytes[k0:k0 + n, c * 128:(c + 1) * 128]
    lin = np.arange(BN * 128)
    phys = lin ^ (((lin >> 7) & 7) << 4)  # SWIZZLE_128B on a 1024-byte aligned destination
    img[c * BN * 128 + phys] = box.reshape(-1)
  return img


def _kernel_tile(x8, xs, b, kh, k0, H, check_banks=True):
  """dequant_kv_tile's writes for one tensor, transcribed: returns the image and the write count
  per byte."""
  B, S, Kh, _ = x8.shape
  kGroups = H // 16
  kRowsPerPass = THREADS // kGroups
  kPasses = BN // kRowsPerPass
  assert kRowsPerPass * kPasses == BN
  flat8 = x8.reshape(-1)
  flats = xs.reshape(-1)
  img = np.full(2 * H // 128 * BN * 128, 0xAA, np.uint8)
  count = np.zeros(img.size, np.int32)
  # stores[(i, j)] = list of (thread, byte offset): one store instruction of the unrolled code
  stores = {}
  for t in range(THREADS):
    g = t % kGroups
    r0 = t // kGroups
    rows = min(BN, S - k0) - r0
    row = ((b * S + k0 + r0) * Kh + kh)
    step = kRowsPerPass * Kh
    atom, c0 = g // 4, 2 * (g % 4)
    odd = atom & 1
    for i in range(kPasses):
      r = r0 + i * kRowsPerPass
      live = i * kRowsPerPass < rows
      if live:
        ri = row + i * step
        d = flat8[ri * H + 16 * g: ri * H + 16 * g + 16]  # one 16-byte load
        sb = flats[ri * (H // 32) + g // 2]
        vals = _dequant_bf16(d, np.full(16, sb, np.uint8)).view(np.uint8)  # 32 bytes, lo then hi
        lo, hi = vals[:16], vals[16:]
      else:
        lo = hi = np.zeros(16, np.uint8)
      base = atom * BN * 128 + r * 128
      for j in range(2):
        h = j ^ odd
        off = base + (((c0 + h) ^ (r & 7)) << 4)
        img[off:off + 16] = hi if h else lo
        count[off:off + 16] += 1
        stores.setdefault((i, j), []).append((t, off))
  if check_banks:
    for key, lst in stores.items():
      lst.sort()
      assert [t for t, _ in lst] == list(range(THREADS)), key
      for q in range(0, THREADS, 8):  # quarter warps: 8 lanes x 16 bytes = the 32 banks once
        groups = {(off >> 4) & 7 for _, off in lst[q:q + 8]}
        assert len(groups) == 8, (key, q, sorted(groups))
  return img, count


def _mx_operand(rng, B, S, Kh, H):
  """Random MX data covering the corners: NaN elements (0x7f / 0xff), +-0, subnormal e4m3, and
  scale bytes 0 (results below bf16's normal range), 255 (NaN scale), 254 and mid-range."""
  x8 = rng.integers(0, 256, size=(B, S, Kh, H), dtype=np.uint8)
  xs = rng.integers(100, 150, size=(B, S, Kh, H // 32), dtype=np.uint8)
  special = np.array([0, 1, 2, 3, 120, 127, 128, 200, 253, 254, 255], np.uint8)
  mask = rng.random(xs.shape) < 0.3
  xs[mask] = rng.choice(special, size=int(mask.sum()))
  return x8, xs


@pytest.mark.parametrize("H", [64, 128, 256])
@pytest.mark.parametrize("S", [1, 100, 128, 200, 256, 300])
def test_kernel_tiles_equal_tma_tiles(H, S):
  rng = np.random.default_rng(1000 * H + S)
  B, Kh = 2, 3
  k8, ks = _mx_operand(rng, B, S, Kh, H)
  v8, vs = _mx_operand(rng, B, S, Kh, H)
  kbf, vbf = _bf16_copy(k8, ks, H), _bf16_copy(v8, vs, H)
  n_tiles = -(-S // BN)
  for b in range(B):
    for kh in range(Kh):
      for n_tile in range(n_tiles):
        k0 = n_tile * BN
        for x8, xs, xbf in ((k8, ks, kbf), (v8, vs, vbf)):
          want = _tma_tile(xbf, b, kh, k0, H)
          got, count = _kernel_tile(x8, xs, b, kh, k0, H, check_banks=(b == 0 and kh == 0))
          assert (count == 1).all(), "every tile byte written exactly once"
          np.testing.assert_array_equal(got, want, err_msg=f"H={H} S={S} b={b} kh={kh} k0={k0}")


def test_dequant_model_matches_jnp_dequantize_on_normal_values():
  """The value model agrees with jax_fa4.mx.dequantize (-> bf16) where the fp32 product is normal
  (XLA flushes fp32 subnormals; the device does not, and neither does this model)."""
  jnp = pytest.importorskip("jax.numpy")
  from jax_fa4 import mx
  rng = np.random.default_rng(7)
  x8 = rng.integers(0, 256, size=(4, 64), dtype=np.uint8)
  x8[(x8 & 0x7f) == 0x7f] = 0x3c  # no NaN elements: the jnp path's NaN payloads may differ
  xs = rng.integers(60, 200, size=(4, 2), dtype=np.uint8)
  arr = mx.MXArray(data=jnp.asarray(x8.view(E4M3)), scale=mx.e8m0_from_bytes(jnp.asarray(xs)), axis=1)
  want = np.asarray(arr.dequantize(jnp.bfloat16)).view(np.uint16)
  got = _bf16_copy(x8[:, None, None, :], xs[:, None, None, :], 64)[:, 0, 0, :]
  np.testing.assert_array_equal(got, want)
