"""A byte-level decoder-only LM trained with jax.jit over a ('data', 'model') mesh.

pjit style: parameters carry nnx sharding annotations (tensor parallel on 'model'), the batch is
split on 'data', and one ``jax.jit`` with explicit ``in_shardings``/``out_shardings`` runs the
whole step; there is no per-device code. optax AdamW, orbax checkpoints that resume, a progress
bar, a JSON log. ``--attention`` picks jax_fa4 (MXFP8), jax.nn cudnn (bf16) or jax.nn xla.

Data: the Python standard library's own top-level ``*.py`` files (sorted, as bytes); files whose
crc32(name) % 20 == 0 are the fixed held-out split. Batches are a pure function of (seed, step),
so a resumed run sees exactly the batches the uninterrupted run would have seen.

  python examples/train_lm.py --preset tiny --steps 50                      # CPU, seconds
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python examples/train_lm.py --preset tiny --steps 50 --mesh 4,2       # 8 fake devices
  python examples/train_lm.py --preset 20m --attention jax_fa4 --log fa4.json   # one GPU

The functions are importable (tests load this file with importlib): ``parse_args``, ``run``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import os
import sys
import time
import types
import zlib
from typing import Optional

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _use_checkout_if_needed():
  """An installed jax_fa4 (or one on PYTHONPATH) is used when it has the Flax layers; otherwise
  this checkout's (runnable without installing, e.g. on the GPU machine)."""
  try:
    import jax_fa4.flax_attention  # noqa: F401
  except ImportError:
    for name in [m for m in sys.modules if m == "jax_fa4" or m.startswith("jax_fa4.")]:
      del sys.modules[name]
    sys.path.insert(0, _ROOT)


_use_checkout_if_needed()

PRESETS = {
    # name: (d_model, n_layers, n_heads, n_kv_heads, seq_len, batch)
    "tiny": dict(d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, seq_len=64, batch=8),
    "20m": dict(d_model=512, n_layers=6, n_heads=8, n_kv_heads=8, seq_len=1024, batch=16),
}


# ----------------------------------------------------------------------------------------------
# Data

def stdlib_files():
  """The standard library's top-level *.py files, sorted (the corpus of this example)."""
  import os as _os
  return sorted(glob.glob(os.path.join(os.path.dirname(_os.__file__), "*.py")))


def is_heldout(path: str) -> bool:
  return zlib.crc32(os.path.basename(path).encode()) % 20 == 0


def load_corpus():
  """(train bytes, held-out bytes) as uint8 arrays; files are joined with a NUL separator."""
  train, held = [], []
  for f in stdlib_files():
    with open(f, "rb") as fh:
      (held if is_heldout(f) else train).append(fh.read() + b"\0")
  as_arr = lambda parts: np.frombuffer(b"".join(parts), dtype=np.uint8)
  return as_arr(train), as_arr(held)


def train_batch(data: np.ndarray, seed: int, step: int, batch: int, seq_len: int):
  """[batch, seq_len + 1] int32 windows at offsets drawn from (seed, step) only."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
  return np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def eval_batches(data: np.ndarray, n_batches: int, batch: int, seq_len: int):
  """Fixed, evenly spaced held-out windows: the same for every run with the same shape."""
  n = n_batches * batch
  starts = np.linspace(0, len(data) - seq_len - 1, n).astype(np.int64)
  wins = np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)
  return wins.reshape(n_batches, batch, seq_len + 1)


# ----------------------------------------------------------------------------------------------
# Model

@dataclasses.dataclass(frozen=True)
class ModelConfig:
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  seq_len: int
  attention: str = "jax_fa4"
  implementation: Optional[str] = None  # jax_fa4 backend
  dtype: str = "bfloat16"
  vocab: int = 256
  mlp_ratio: int = 4


def build_model_cls():
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax_fa4.flax_attention import Attention

  def part(init, axes):
    return nnx.with_partitioning(init, axes)

  class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs):
      dt = jnp.dtype(cfg.dtype)
      d, f = cfg.d_model, cfg.mlp_ratio * cfg.d_model
      out_init = nnx.initializers.normal(0.02 / np.sqrt(2 * cfg.n_layers))
      self.norm1 = nnx.RMSNorm(d, dtype=dt, rngs=rngs)
      self.attn = Attention(d, cfg.n_heads, cfg.n_kv_heads, is_causal=True, dtype=dt,
                            attention=cfg.attention, implementation=cfg.implementation,
                            kernel_init=nnx.initializers.normal(0.02), out_kernel_init=out_init,
                            model_axis="model", rngs=rngs)
      self.norm2 = nnx.RMSNorm(d, dtype=dt, rngs=rngs)
      self.up = nnx.Linear(d, f, dtype=dt, kernel_init=part(nnx.initializers.normal(0.02),
                                                             (None, "model")),
                           bias_init=part(nnx.initializers.zeros_init(), ("model",)), rngs=rngs)
      self.down = nnx.Linear(f, d, dtype=dt, kernel_init=part(out_init, ("model", None)),
                             bias_init=part(nnx.initializers.zeros_init(), (None,)), rngs=rngs)

    def __call__(self, x):
      x = x + self.attn(self.norm1(x))
      return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

  class LM(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs):
      dt = jnp.dtype(cfg.dtype)
      self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dt,
                             embedding_init=part(nnx.initializers.normal(1.0), (None, "model")),
                             rngs=rngs)
      self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)]) \
          if hasattr(nnx, "List") else [Block(cfg, rngs) for _ in range(cfg.n_layers)]
      self.norm = nnx.RMSNorm(cfg.d_model, dtype=dt, rngs=rngs)
      self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, dtype=dt,
                             kernel_init=part(nnx.initializers.normal(0.02), (None, "model")),
                             rngs=rngs)

    def __call__(self, tokens):
      x = self.embed(tokens)
      for blk in self.blocks:
        x = blk(x)
      return self.head(self.norm(x)).astype(jnp.float32)

  return LM


def count_params(state) -> int:
  import jax
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))


# ----------------------------------------------------------------------------------------------
# Training

def make_mesh(spec: Optional[str]):
  """'D,M' -> Mesh over the first D*M devices with axes ('data', 'model'); None: all on data."""
  import jax
  from jax.sharding import Mesh
  devs = jax.devices()
  if spec is None:
    d, m = len(devs), 1
  else:
    d, m = (int(s) for s in spec.split(","))
  if d * m > len(devs):
    raise ValueError(f"--mesh {d},{m} needs {d * m} devices; jax sees {len(devs)}")
  return Mesh(np.array(devs[:d * m]).reshape(d, m), ("data", "model"))


def _progress(total: int, initial: int):
  try:
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, dynamic_ncols=True, file=sys.stderr)
  except ImportError:
    return None


@functools.lru_cache(maxsize=4)
def build_programs(cfg: ModelConfig, mesh, seed: int, lr: float, warmup: int, steps: int,
                   weight_decay: float):
  """The sharded programs of one configuration: abstract params, shardings, jitted init,
  train step and eval loss. Cached, so runs of one configuration in one process (a resume)
  reuse the compiled executables."""
  import jax
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P

  # Parameters: abstract model -> partition specs -> jit(init) with those out_shardings.
  LM = build_model_cls()
  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(lambda: LM(cfg, nnx.Rngs(seed)))
  graphdef, abs_params = nnx.split(abstract, nnx.Param)
  specs = nnx.get_partition_spec(abs_params)
  is_p = lambda x: isinstance(x, P)
  param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_p)
  replicated = NamedSharding(mesh, P())
  batch_sh = NamedSharding(mesh, P("data", None))

  def init_params():
    with nnx.use_eager_sharding(False):
      return nnx.split(LM(cfg, nnx.Rngs(seed)), nnx.Param)[1]

  warmup = max(0, min(warmup, steps - 1))
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1),
                                             end_value=lr * 0.1)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=weight_decay))
  abs_opt = jax.eval_shape(tx.init, abs_params)
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, abs_opt, param_sh,
                                 transform_non_params=lambda _: replicated)

  def loss_fn(params, tokens):
    model = nnx.merge(graphdef, params)
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def train_step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return types.SimpleNamespace(
      abs_params=abs_params, abs_opt=abs_opt, param_sh=param_sh, opt_sh=opt_sh,
      batch_sh=batch_sh,
      init_params=jax.jit(init_params, out_shardings=param_sh),
      init_opt=jax.jit(tx.init, in_shardings=(param_sh,), out_shardings=opt_sh),
      step_fn=jax.jit(train_step, in_shardings=(param_sh, opt_sh, batch_sh),
                      out_shardings=(param_sh, opt_sh, replicated), donate_argnums=(0, 1)),
      eval_fn=jax.jit(loss_fn, in_shardings=(param_sh, batch_sh), out_shardings=replicated))


def run(args) -> dict:
  """Trains per ``args`` (from ``parse_args``); returns the log dict that is written as JSON."""
  import jax
  import jax_fa4

  p = dict(PRESETS[args.preset])
  for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "seq_len", "batch"):
    if getattr(args, k, None) is not None:
      p[k] = getattr(args, k)
  batch = p.pop("batch")
  cfg = ModelConfig(**p, attention=args.attention, implementation=args.implementation,
                    dtype=args.dtype)
  if args.attention == "cudnn" and jax.default_backend() != "gpu":
    raise ValueError(f"--attention cudnn needs a GPU; jax's default backend is "
                     f"{jax.default_backend()!r} (use --attention xla or jax_fa4)")
  mesh = make_mesh(args.mesh)
  if batch % mesh.shape["data"]:
    raise ValueError(f"batch={batch} must be divisible by the 'data' axis {mesh.shape['data']}")

  train_data, held_data = load_corpus()
  evals = eval_batches(held_data, args.eval_batches, batch, cfg.seq_len)

  prog = build_programs(cfg, mesh, args.seed, args.lr, args.warmup, args.steps,
                        args.weight_decay)
  abs_params, abs_opt = prog.abs_params, prog.abs_opt
  param_sh, opt_sh, batch_sh = prog.param_sh, prog.opt_sh, prog.batch_sh
  step_fn, eval_fn = prog.step_fn, prog.eval_fn

  # Checkpoints: resume from the latest one in --ckpt-dir.
  mngr = None
  start = 0
  if args.ckpt_dir:
    import orbax.checkpoint as ocp
    mngr = ocp.CheckpointManager(
        os.path.abspath(args.ckpt_dir),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
  if mngr is not None and mngr.latest_step() is not None:
    import orbax.checkpoint as ocp
    start = int(mngr.latest_step())
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          dict(params=abs_params, opt_state=abs_opt),
                          dict(params=param_sh, opt_state=opt_sh))
    restored = mngr.restore(start, args=ocp.args.StandardRestore(target))
    params, opt_state = restored["params"], restored["opt_state"]
  else:
    params = prog.init_params()
    opt_state = prog.init_opt(params)

  def evaluate(params):
    return float(np.mean([float(eval_fn(params, jax.device_put(b, batch_sh))) for b in evals]))

  n_params = count_params(abs_params)
  stop = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
  log = dict(config=dict(vars(args), **dataclasses.asdict(cfg), batch=batch, n_params=n_params,
                         mesh=dict(mesh.shape), devices=[str(d) for d in mesh.devices.flat],
                         jax=jax.__version__, backend=jax.default_backend(),
                         jax_fa4=os.path.dirname(jax_fa4.__file__),
                         jax_fa4_backends=jax_fa4.available_backends()),
             start_step=start, steps=[], evals=[])
  print(f"[train_lm] {n_params / 1e6:.2f}M params, attention={cfg.attention}, "
        f"dtype={cfg.dtype}, mesh={dict(mesh.shape)}, batch={batch}x{cfg.seq_len}, "
        f"train {len(train_data)} B, held-out {len(held_data)} B, steps {start}->{stop}",
        flush=True)

  bar = None if args.no_progress else _progress(stop, start)
  tokens_per_step = batch * cfg.seq_len
  t_begin = time.perf_counter()
  for step in range(start, stop):
    if args.time_limit is not None and time.perf_counter() - t_begin > args.time_limit:
      print(f"[train_lm] --time-limit {args.time_limit}s reached at step {step}", flush=True)
      break
    tokens = jax.device_put(train_batch(train_data, args.seed, step, batch, cfg.seq_len),
                            batch_sh)
    t0 = time.perf_counter()
    params, opt_state, loss = step_fn(params, opt_state, tokens)
    loss = float(loss)  # waits for the step
    dt = time.perf_counter() - t0
    log["steps"].append(dict(step=step, loss=loss, time=dt, wall=time.perf_counter() - t_begin))
    if not np.isfinite(loss):
      print(f"[train_lm] non-finite loss {loss} at step {step}", flush=True)
      break
    if bar is not None:
      bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_step / dt:,.0f}", refresh=False)
      bar.update(1)
    elif (step + 1) % args.log_every == 0 or step == start:
      print(f"step {step + 1}/{stop} loss {loss:.4f} {tokens_per_step / dt:,.0f} tok/s",
            flush=True)
    done = step + 1
    if args.eval_every and done % args.eval_every == 0 and done < stop:
      log["evals"].append(dict(step=done, loss=evaluate(params)))
    if mngr is not None and args.ckpt_every and done % args.ckpt_every == 0:
      import orbax.checkpoint as ocp
      mngr.save(done, args=ocp.args.StandardSave(dict(params=params, opt_state=opt_state)))
  if bar is not None:
    bar.close()

  last = start + len(log["steps"])
  if mngr is not None:
    import orbax.checkpoint as ocp
    if last > start and mngr.latest_step() != last:
      mngr.save(last, args=ocp.args.StandardSave(dict(params=params, opt_state=opt_state)),
                force=True)
    mngr.wait_until_finished()
    mngr.close()
  final = evaluate(params)
  log["evals"].append(dict(step=last, loss=final))
  times = [s["time"] for s in log["steps"][1:]]  # the first step of a process compiles
  log["final_heldout_loss"] = final
  log["mean_step_time"] = float(np.mean(times)) if times else None
  log["tokens_per_s"] = tokens_per_step / log["mean_step_time"] if times else None
  msg = f"[train_lm] final held-out loss {final:.4f} nats/byte"
  if times:
    msg += (f"; mean step time {log['mean_step_time'] * 1e3:.1f} ms over {len(times)} steps "
            f"({log['tokens_per_s']:,.0f} tok/s)")
  print(msg, flush=True)
  if args.log:
    os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
    with open(args.log, "w") as fh:
      json.dump(log, fh, indent=1)
  if args.plot:
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "plot_convergence", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "plot_convergence.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.plot([log], [cfg.attention], args.plot)
  return log


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
  ap.add_argument("--attention", choices=("jax_fa4", "cudnn", "xla"), default="jax_fa4",
                  help="jax_fa4 (MXFP8), or jax.nn.dot_product_attention with cudnn/xla")
  ap.add_argument("--implementation", choices=("xla", "cpu", "cuda", "cuda_fp8"), default=None,
                  help="jax_fa4 backend (default: the fastest available)")
  ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                  help="computation dtype (parameters are float32)")
  for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "seq_len", "batch"):
    ap.add_argument("--" + k.replace("_", "-"), dest=k, type=int, default=None,
                    help="override the preset")
  ap.add_argument("--steps", type=int, default=200, help="total steps (sets the LR schedule)")
  ap.add_argument("--stop-at", type=int, default=None,
                  help="stop after this step (as if interrupted); resume with the same --steps")
  ap.add_argument("--time-limit", type=float, default=None,
                  help="stop the training loop after this many seconds")
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--warmup", type=int, default=50)
  ap.add_argument("--weight-decay", type=float, default=0.1)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--mesh", default=None, help="'D,M': data x model devices (default: all, 1)")
  ap.add_argument("--eval-batches", type=int, default=8)
  ap.add_argument("--eval-every", type=int, default=0)
  ap.add_argument("--ckpt-dir", default=None)
  ap.add_argument("--ckpt-every", type=int, default=0)
  ap.add_argument("--log", default=None, help="JSON log path")
  ap.add_argument("--plot", default=None, help="PNG of the loss curve (needs matplotlib)")
  ap.add_argument("--log-every", type=int, default=10)
  ap.add_argument("--no-progress", action="store_true")
  return ap.parse_args(argv)


def main(argv=None):
  return run(parse_args(argv))


if __name__ == "__main__":
  main()
