"""Grouped 2-D convolutions as Pallas implicit-GEMM kernels (grouped_conv_impl 'pallas').

A tile of output pixels times one group's output channels is a sum over the kernel's taps
and chunks of the group's input channels of [pixels, chunk] x [chunk, group width] products
(Tiles says how big), each tap's rows read straight from the NHWC activations: no window is
copied through memory (im2col, the cost of 'gemm', layers.conv_as_gemm), no group's
channels sliced out and concatenated back ('split'). The input gradient is the same sum
over taps of the output gradient's rows (the kernel transposed; strided, by stride phase,
so that each program sums only its pixels' taps); the kernel's gradient, per group and tap,
a sum over chunks of pixels, split over pixels so that a few groups still fill the chip,
the splits summed in float32 after.

On NVIDIA GPUs the kernels are Triton's (the CUDA plugin compiles them deviceless too, for
the plan and benchmarks/gpu_hlo.py); on other platforms Pallas's interpreter runs the same
kernels (the tests, the CPU dry run of benchmarks/accelerator.py). Tiles are powers of two
of at least 16 (Triton's), so a group width of 112 (RegNetY's) is computed as 128 output
channels, masked.
"""
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# How many programs the kernel gradient's pixel splits aim at (a few per streaming
# multiprocessor of an H100's 132).
KERNEL_GRAD_PROGRAMS = 512


class Tiles(NamedTuple):
  """The kernels' tiling: pixels per program (the forward's and input gradient's M), the
  products' contraction per step (K: channels in those two, pixels in the kernel gradient),
  and Triton's warps per program and software-pipeline stages."""
  pixels: int = 128
  k: int = 32
  num_warps: int = 4
  num_stages: int = 3


TILES = Tiles()  # What grouped_conv_impl 'pallas' runs with.


class _Geometry(NamedTuple):
  """Static shape of one convolution: NHWC input, HWIO kernel, explicit padding."""
  n: int
  h: int
  w: int
  kh: int
  kw: int
  stride: tuple[int, int]
  pad: tuple[int, int]  # Top and left (bottom and right follow from the output size).
  tiles: Tiles
  groups: int
  per_group: int  # Input channels per group.
  out_per_group: int
  out_h: int
  out_w: int
  precision: Any = None  # The products', as lax.dot_general takes it (None: the default).

  @property
  def pixels(self) -> int:  # Output pixels.
    return self.n * self.out_h * self.out_w


def _tile(n: int) -> int:
  """A tile's width for n channels: Triton's tiles are powers of two, its products' >= 16."""
  return max(16, 1 << (n - 1).bit_length())


def _pixel(rows, h: int, w: int):
  """(image, y, x) of each flat index `rows` into h x w NHWC images."""
  return rows // (h * w), rows % (h * w) // w, rows % w


def _indices(ref, rows, cols, shape, interpret):
  """ref's [rows[:, None], cols[None, :]] indices, broadcast to `shape`. Triton reads and
  writes no masked lane, and indices left as computed keep what its analysis needs to see
  that a row's columns are contiguous and aligned, so that it moves them 16 bytes at a time
  (clipped, it loads each element alone); the interpreter touches every lane, so there they
  are clipped into bounds."""
  if interpret:
    rows, cols = jnp.clip(rows, 0, ref.shape[0] - 1), jnp.clip(cols, 0, ref.shape[1] - 1)
  return jnp.broadcast_to(rows[:, None], shape), jnp.broadcast_to(cols[None, :], shape)


def _gather(ref, rows, cols, mask, interpret):
  """ref[rows[:, None], cols[None, :]] where `mask`, 0 elsewhere."""
  r, c = _indices(ref, rows, cols, mask.shape, interpret)
  return pltriton.load(ref.at[r, c], mask=mask, other=0)


def _scatter(ref, rows, cols, value, mask, interpret):
  """ref[rows[:, None], cols[None, :]] = value where `mask`. Pallas's interpreter writes the
  masked lanes too (their old values, in one scatter with the others), so there they go to
  the extra last row that each output has under the interpreter, never to a written one."""
  r, c = _indices(ref, rows, cols, mask.shape, interpret)
  if interpret:
    r = jnp.where(mask, r, ref.shape[0] - 1)
  pltriton.store(ref.at[r, c], value, mask=mask)


def _dot(a, b, a_dim: int, b_dim: int, precision):
  """The float32 product of 2-D tiles contracting a's a_dim with b's b_dim at `precision`:
  one Triton dot, either operand transposed in the kernel (what pl.dot did; JAX 0.11 dropped
  it)."""
  return jax.lax.dot_general(a, b, (((a_dim,), (b_dim,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def _call(kernel, out_rows, out_cols, dtype, grid, tiles, interpret, macs, *args):
  """pallas_call of `kernel` over 2-D operands into a [out_rows, out_cols] result, varying
  over the manual mesh axes (in a shard_map) as its first operand does. `macs`: the
  multiply-adds its programs compute, tile padding included; with each operand read and the
  result written once, the kernel's cost estimate (what bigpretrain/plan/flops.py counts)."""
  out_shape = jax.ShapeDtypeStruct((out_rows + interpret, out_cols), dtype,
                                   manual_axis_type=jax.typeof(args[0]).mat)
  nbytes = sum(a.size * a.dtype.itemsize for a in args) + out_rows * out_cols * jnp.dtype(
      dtype).itemsize
  out = pl.pallas_call(
      functools.partial(kernel, interpret=interpret), out_shape=out_shape, grid=grid,
      interpret=interpret, compiler_params=None if interpret else pltriton.CompilerParams(
          num_warps=tiles.num_warps, num_stages=tiles.num_stages),
      cost_estimate=pl.CostEstimate(flops=2 * macs, transcendentals=0,
                                    bytes_accessed=nbytes))(*args)
  return out[:out_rows] if interpret else out


def _on_platform(fn, *args):
  """fn(*args, interpret=...) as Triton kernels when lowered for CUDA, interpreted elsewhere."""
  return jax.lax.platform_dependent(
      *args, cuda=functools.partial(fn, interpret=False),
      default=functools.partial(fn, interpret=True))


def _forward(x, w, geo: _Geometry, dtype, *, interpret):
  """[pixels, groups x out_per_group]: the convolution of x [n h w, groups x per_group] with
  w [kh kw per_group, groups x out_per_group]; a program's steps are (tap, channel chunk)."""
  c, o, bm, bk = geo.per_group, geo.out_per_group, geo.tiles.pixels, geo.tiles.k
  op, chunks = _tile(o), pl.cdiv(c, bk)
  (sh, sw), (pt, pl_) = geo.stride, geo.pad

  def conv_forward(x_ref, w_ref, y_ref, *, interpret):
    rows = pl.program_id(0) * bm + jnp.arange(bm)
    g = pl.program_id(1)
    b, oy, ox = _pixel(rows, geo.out_h, geo.out_w)
    co = jnp.arange(op)
    omask = co < o

    def step(s, acc):  # (Remainders as s - q * d: Triton's lowering fails on a loop index's %.)
      t = s // chunks
      i = t // geo.kw
      ci = (s - t * chunks) * bk + jnp.arange(bk)
      iy, ix = oy * sh + i - pt, ox * sw + t - i * geo.kw - pl_
      valid = (rows < geo.pixels) & (iy >= 0) & (iy < geo.h) & (ix >= 0) & (ix < geo.w)
      xt = _gather(x_ref, (b * geo.h + iy) * geo.w + ix, g * c + ci,
                   valid[:, None] & (ci < c)[None, :], interpret)
      wt = _gather(w_ref, t * c + ci, g * o + co, (ci < c)[:, None] & omask[None, :], interpret)
      return acc + _dot(xt, wt, 1, 0, geo.precision)

    acc = jax.lax.fori_loop(0, geo.kh * geo.kw * chunks, step,
                            jnp.zeros((bm, op), jnp.float32))
    _scatter(y_ref, rows, g * o + co, acc.astype(y_ref.dtype),
             (rows < geo.pixels)[:, None] & omask[None, :], interpret)

  grid = (pl.cdiv(geo.pixels, bm), geo.groups)
  macs = grid[0] * bm * geo.groups * geo.kh * geo.kw * chunks * bk * op
  return _call(conv_forward, geo.pixels, geo.groups * o, dtype, grid, geo.tiles, interpret,
               macs, x, w)


def _input_grad(dy, w, geo: _Geometry, dtype, *, interpret):
  """[n h w, groups x per_group]: the gradient of x from dy [pixels, groups x
  out_per_group]; an input pixel gets each tap's output pixel whose window holds it. Strided:
  the input pixels come in stride-phase classes (y mod sh, x mod sw), each a program's rows,
  since only the taps of a pixel's phase reach an output pixel: every product counts. A
  program's steps are (its phase's tap, output-channel chunk)."""
  c, o, bm, bk = geo.per_group, geo.out_per_group, geo.tiles.pixels, geo.tiles.k
  cp, chunks = _tile(c), pl.cdiv(o, bk)
  (sh, sw), (pt, pl_) = geo.stride, geo.pad
  uh, uw = pl.cdiv(geo.h, sh), pl.cdiv(geo.w, sw)  # A phase's rows and columns (at most).
  per_phase = geo.n * uh * uw

  def conv_input_grad(dy_ref, w_ref, dx_ref, *, interpret):
    rows = pl.program_id(0) * bm + jnp.arange(bm)
    g, phase = pl.program_id(1), pl.program_id(2)
    py, px = phase // sw, phase % sw
    b, u, v = _pixel(rows, uh, uw)
    iy, ix = py + u * sh, px + v * sw
    live = (rows < per_phase) & (iy < geo.h) & (ix < geo.w)
    i0, j0 = (py + pt) % sh, (px + pl_) % sw  # The phase's first tap row and column.
    tap_cols = (geo.kw - j0 + sw - 1) // sw
    ci = jnp.arange(cp)
    cmask = ci < c

    def step(s, acc):
      tap = s // chunks
      ki = tap // tap_cols
      i, j = i0 + ki * sh, j0 + (tap - ki * tap_cols) * sw
      co = (s - tap * chunks) * bk + jnp.arange(bk)
      oy, ox = (iy + pt - i) // sh, (ix + pl_ - j) // sw  # Exact: i, j are of the phase.
      valid = live & (oy >= 0) & (oy < geo.out_h) & (ox >= 0) & (ox < geo.out_w)
      dyt = _gather(dy_ref, (b * geo.out_h + oy) * geo.out_w + ox, g * o + co,
                    valid[:, None] & (co < o)[None, :], interpret)
      wt = _gather(w_ref, (i * geo.kw + j) * c + ci, g * o + co,
                   cmask[:, None] & (co < o)[None, :], interpret)
      return acc + _dot(dyt, wt, 1, 1, geo.precision)

    taps = (geo.kh - i0 + sh - 1) // sh * tap_cols
    acc = jax.lax.fori_loop(0, taps * chunks, step, jnp.zeros((bm, cp), jnp.float32))
    _scatter(dx_ref, (b * geo.h + iy) * geo.w + ix, g * c + ci, acc.astype(dx_ref.dtype),
             live[:, None] & cmask[None, :], interpret)

  grid = (pl.cdiv(per_phase, bm), geo.groups, sh * sw)
  # The phases' taps add up to the kernel's: each program of a phase runs that phase's.
  macs = grid[0] * bm * geo.groups * geo.kh * geo.kw * chunks * bk * cp
  return _call(conv_input_grad, geo.n * geo.h * geo.w, geo.groups * c, dtype, grid,
               geo.tiles, interpret, macs, dy, w)


def _kernel_grad(x, dy, geo: _Geometry, *, interpret):
  """[kh kw per_group, groups x out_per_group] float32: the gradient of w, per (group, tap)
  a sum over chunks of output pixels, in `splits` runs of chunks summed after."""
  c, o, bk = geo.per_group, geo.out_per_group, geo.tiles.k
  cp, op = _tile(c), _tile(o)
  (sh, sw), (pt, pl_) = geo.stride, geo.pad
  taps, chunks = geo.kh * geo.kw, pl.cdiv(geo.pixels, bk)
  per_split = pl.cdiv(chunks, min(chunks, max(1, KERNEL_GRAD_PROGRAMS // (geo.groups * taps))))
  splits = pl.cdiv(chunks, per_split)

  def conv_kernel_grad(x_ref, dy_ref, dw_ref, *, interpret):
    g, t, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    i, j = t // geo.kw, t % geo.kw
    ci, co = jnp.arange(cp), jnp.arange(op)
    cmask, omask = ci < c, co < o

    def step(k, acc):
      rows = k * bk + jnp.arange(bk)
      b, oy, ox = _pixel(rows, geo.out_h, geo.out_w)
      iy, ix = oy * sh + i - pt, ox * sw + j - pl_
      live = rows < geo.pixels
      valid = live & (iy >= 0) & (iy < geo.h) & (ix >= 0) & (ix < geo.w)
      xt = _gather(x_ref, (b * geo.h + iy) * geo.w + ix, g * c + ci,
                   valid[:, None] & cmask[None, :], interpret)
      dyt = _gather(dy_ref, rows, g * o + co, live[:, None] & omask[None, :], interpret)
      return acc + _dot(xt, dyt, 0, 0, geo.precision)

    acc = jax.lax.fori_loop(s * per_split, jnp.minimum((s + 1) * per_split, chunks), step,
                            jnp.zeros((cp, op), jnp.float32))
    _scatter(dw_ref, (s * taps + t) * c + ci, g * o + co, acc,
             cmask[:, None] & omask[None, :], interpret)

  macs = geo.groups * taps * chunks * bk * cp * op
  partial = _call(conv_kernel_grad, splits * taps * c, geo.groups * o, jnp.float32,
                  (geo.groups, taps, splits), geo.tiles, interpret, macs, x, dy)
  return partial.reshape(splits, taps * c, geo.groups * o).sum(0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv(x, w, geo: _Geometry, dtype):
  return _on_platform(functools.partial(_forward, geo=geo, dtype=dtype), x, w)


def _conv_fwd(x, w, geo, dtype):
  return _conv(x, w, geo, dtype), (x, w)


def _conv_bwd(geo, dtype, res, dy):
  del dtype  # The output's; the gradients take their operands' dtypes.
  x, w = res
  dy = dy.astype(x.dtype)  # conv_pallas casts w to x's dtype: products of one dtype.
  dx = _on_platform(functools.partial(_input_grad, geo=geo, dtype=x.dtype), dy, w)
  dw = _on_platform(functools.partial(_kernel_grad, geo=geo), x, dy)
  return dx, dw.astype(w.dtype)


_conv.defvjp(_conv_fwd, _conv_bwd)


def conv_pallas(lhs: jax.Array, rhs: jax.Array, window_strides, padding, lhs_dilation=None,
                rhs_dilation=None, dimension_numbers=None, feature_group_count: int = 1,
                precision=None, preferred_element_type=None, out_sharding=None,
                tiles: Tiles = TILES) -> jax.Array:
  """jax.lax.conv_general_dilated of 2-D NHWC images with an HWIO kernel (nnx.Conv's layout)
  computed by this module's kernels, tiled as `tiles` says: the same sums up to their order
  (products at `precision` as XLA's: by default, of float32 operands, the GPU's TF32). Dilated
  convolutions and other layouts raise ValueError."""
  del out_sharding  # The callers pin their outputs themselves (batch_local_conv).
  if any(n < 16 or n & (n - 1) for n in (tiles.pixels, tiles.k)):
    raise ValueError(f"{tiles}: pixels and k must be powers of two >= 16 (Triton's).")
  if (any(d != 1 for d in (lhs_dilation or ()) + (rhs_dilation or ()))
      or lhs.ndim != 4 or jax.lax.conv_dimension_numbers(
          lhs.shape, rhs.shape, dimension_numbers) != jax.lax.conv_dimension_numbers(
              lhs.shape, rhs.shape, ("NHWC", "HWIO", "NHWC"))):
    raise ValueError("conv_pallas takes undilated 2-D convolutions of NHWC images with "
                     f"HWIO kernels; got dimension_numbers={dimension_numbers}, "
                     f"lhs_dilation={lhs_dilation}, rhs_dilation={rhs_dilation}.")
  n, h, w, channels = lhs.shape
  kh, kw, per_group, out_channels = rhs.shape
  if isinstance(padding, str):
    padding = jax.lax.padtype_to_pads((h, w), (kh, kw), window_strides, padding)
  (pt, pb), (pl_, pr) = padding
  sh, sw = window_strides
  geo = _Geometry(n, h, w, kh, kw, (sh, sw), (pt, pl_), tiles, feature_group_count, per_group,
                  out_channels // feature_group_count, (h + pt + pb - kh) // sh + 1,
                  (w + pl_ + pr - kw) // sw + 1,
                  tuple(precision) if isinstance(precision, list) else precision)
  rhs = rhs.astype(lhs.dtype)
  y = _conv(lhs.reshape(n * h * w, channels), rhs.reshape(kh * kw * per_group, out_channels),
            geo, jnp.dtype(preferred_element_type or lhs.dtype))
  return y.reshape(n, geo.out_h, geo.out_w, out_channels)
