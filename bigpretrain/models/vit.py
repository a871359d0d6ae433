"""Vision Transformer (Dosovitskiy et al. 2021) with the DeiT / DeiT-III / cosub options.

Pre-norm blocks  x + DP(LS(attn(LN(x))))  and  x + DP(LS(mlp(LN(x)))), exact GELU, a final
LayerNorm and a linear head. DP is per-sample stochastic depth drawn from the explicit `rng`
call argument, independently per block and per residual branch; LS is optional LayerScale.
`stochastic_depth='mask'` computes every branch on every row and zeroes the dropped rows;
'esd' (efficient stochastic depth, cosub supplement C) computes each branch only on the kept
rows of each data shard (layers.esd_residual), which saves compute and activation memory.

Init: patch embedding lecun-normal, attention/MLP kernels xavier-uniform, position embedding
truncated-normal(0.02), class token zeros, and a zero-initialised head (as big_vision does:
every class starts at logit 0; pass head_zeroinit=False for truncated-normal(0.02)).

pre_logits=True adds the representation layer before the classifier, Linear(width, width)
then tanh: SWAG section 3.2 ("an additional linear layer with output dimension equal to the
input dimension, similar to [ViT]"); the tanh and the layout follow torchvision's
`representation_size` head (heads.pre_logits + Tanh) and ClassyVision's, which SWAG's code
uses, so their weights map one to one. Its init: lecun-normal kernel, zero bias (as theirs).

Parameter paths (weight decay's exclusions and the layer order, STEM / TOP, name them):
patch_embed/{kernel,bias}, cls_token, pos_embed, blocks/<i>/{norm1,attn/qkv,attn/proj,ls1,
norm2,mlp/fc1,mlp/fc2,ls2}/..., norm/{scale,bias}, pre_logits/{kernel,bias} (optional),
head/{kernel,bias}.
"""
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np

from bigpretrain import sharding
from bigpretrain.models import base
from bigpretrain.models import layers

# name -> (width, depth, heads, mlp_dim)
_SIZES = {
    "ti": (192, 12, 3, 768),
    "s": (384, 12, 6, 1536),
    "m": (512, 12, 8, 2048),  # DeiT-III's ViT-M (deit models_v2.py deit_medium_patch16_LS).
    "b": (768, 12, 12, 3072),
    "l": (1024, 24, 16, 4096),
    "h": (1280, 32, 16, 5120),
}
_PATCHES = (14, 16, 32)


def _pair(x) -> tuple[int, int]:
  if isinstance(x, int):
    return (x, x)
  h, w = x
  return (int(h), int(w))


def attention(q, k, v, implementation: str = "xla", pad_to: int = 1,
              tokens: int | None = None) -> jax.Array:
  """softmax(q k^T / sqrt(head_dim)) v over [B, N, heads, head_dim] (jax.nn's layout).

  `tokens` < N: only the first `tokens` positions are keys (key_value_seq_lengths); the rest
  are padding the caller added (their rows are computed, attending to the real keys). pad_to
  > 1 pads the sequence with zero tokens to a multiple of `pad_to`, masked alike, and drops
  their rows: the same result as unpadded. cuDNN needs even lengths for ViTs' odd token
  counts (197 at 224 px, patch 16): in training, JAX's cuDNN rule checks its bias-only "even
  sequence length" condition with a zero-size placeholder bias that counts as present, so
  every odd length is refused ("Unsupported sequence length Q 197, KV 197"), bias or not.
  """
  n = q.shape[1]
  extra = -n % pad_to
  tokens = n if tokens is None else tokens
  if not extra and tokens == n:
    return jax.nn.dot_product_attention(q, k, v, implementation=implementation)
  if extra:
    pad = ((0, 0), (0, extra), (0, 0), (0, 0))
    q, k, v = (jnp.pad(t, pad) for t in (q, k, v))
  lengths = jnp.full((q.shape[0],), tokens, jnp.int32)
  out = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                     implementation=implementation)
  return out[:, :n]


class Attention(nnx.Module):
  """Multi-head self-attention with a fused qkv projection laid out [q | k | v] x heads.
  `attention_impl` (layers.ATTENTION_IMPLS) picks the kernel; models.get_model sets it."""

  attention_impl = "xla"

  def __init__(self, dim: int, num_heads: int, *, qkv_bias: bool, dtype, param_dtype,
               rngs: nnx.Rngs):
    if dim % num_heads:
      raise ValueError(f"width {dim} is not divisible by num_heads {num_heads}")
    self.num_heads = num_heads
    init = nnx.initializers.xavier_uniform()
    self.qkv = nnx.Linear(dim, 3 * dim, use_bias=qkv_bias,
                          kernel_init=layers.partitioned(init, ("embed", "heads")),
                          dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.proj = nnx.Linear(dim, dim, kernel_init=layers.partitioned(init, ("heads", "embed")),
                           dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array, tokens: int | None = None) -> jax.Array:
    """`tokens`: how many leading tokens of `x` are real (the rest padding, masked as keys;
    default all)."""
    b, n, d = x.shape
    h, linear, names = self.num_heads, self.qkv, ("embed", None, "heads", None)
    if sharding.constrained_axis(names, (d, 3, h, d // h), "heads") is None:
      qkv = linear(x).reshape(b, n, 3, h, d // h)
    else:
      # Heads split over a mesh axis: the kernel's [q | k | v] columns, sharded in contiguous
      # chunks, cut across q, k and v, so the product's output would be all-gathered over
      # that axis. The kernel is split by heads first instead (a far smaller array to move).
      kernel = linear.kernel[...].reshape(d, 3, h, d // h)
      bias = None if linear.bias is None else linear.bias[...].reshape(3, h, d // h)
      x, kernel, bias = linear.promote_dtype((x, kernel, bias), dtype=linear.dtype)
      kernel = sharding.constrain(kernel, names, "heads")
      qkv = linear.dot_general(x, kernel, (((2,), (0,)), ((), ())),
                               precision=linear.precision)
      if bias is not None:
        qkv += bias
    out = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], self.attention_impl,
                    self.pad_to(), tokens)
    return self.proj(out.reshape(b, n, d))

  def pad_to(self) -> int:
    """The multiple of which the kernel takes sequence lengths (see attention())."""
    return 2 if self.attention_impl == "cudnn" else 1


class Block(nnx.Module):
  """Pre-norm transformer block with optional LayerScale and per-branch stochastic depth."""

  def __init__(self, dim: int, num_heads: int, mlp_dim: int, *, qkv_bias: bool,
               layerscale_init: float | None, drop_path_rate: float, dtype, param_dtype,
               rngs: nnx.Rngs, stochastic_depth: str = "mask"):
    norm = functools.partial(nnx.LayerNorm, dim, epsilon=1e-6, dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs)
    self.norm1 = norm()
    self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, dtype=dtype,
                          param_dtype=param_dtype, rngs=rngs)
    self.norm2 = norm()
    self.mlp = layers.Mlp(dim, mlp_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if layerscale_init is None:
      self.ls1 = self.ls2 = None
    else:
      self.ls1 = layers.LayerScale(dim, layerscale_init, param_dtype=param_dtype)
      self.ls2 = layers.LayerScale(dim, layerscale_init, param_dtype=param_dtype)
    self.drop_path_rate = float(drop_path_rate)
    self.stochastic_depth = layers.check_stochastic_depth_mode(stochastic_depth)

  def _residual(self, x, branch, train, rng):
    """x + DP(branch(x)): masked per-row drop, or ESD on a row subset when training."""
    if train and self.stochastic_depth == "esd":
      return layers.esd_residual(x, branch, self.drop_path_rate, rng)
    y = branch(x)
    if train:
      y = layers.drop_path(y, self.drop_path_rate, rng)
    return x + y

  def _attn_branch(self, x, tokens=None):
    y = self.attn(self.norm1(x), tokens)
    return y if self.ls1 is None else self.ls1(y)

  def _mlp_branch(self, x):
    y = self.mlp(self.norm2(x))
    return y if self.ls2 is None else self.ls2(y)

  def __call__(self, x: jax.Array, *, train: bool = False, rng: jax.Array | None = None,
               tokens: int | None = None):
    """`rng` is this block's key; the two branches fold in 0 (attention) and 1 (MLP).
    `tokens`: how many leading tokens are real, the rest padding (Attention)."""
    attn = functools.partial(self._attn_branch, tokens=tokens)
    x = self._residual(x, attn, train, layers.fold_rng(rng, 0))
    x = self._residual(x, self._mlp_branch, train, layers.fold_rng(rng, 1))
    return x


class VisionTransformer(base.Classifier):
  """ViT classifier: `model(images [B,H,W,3], *, train, rng) -> float32 logits [B, C]`.

  Its position embedding depends on the image size: adapt_param resizes a checkpoint's to
  this model's grid (fine-tuning at a new resolution)."""
  STEM = ("patch_embed", "cls_token", "pos_embed")
  TOP = ("norm", "pre_logits", "head")

  def __init__(self, *, num_classes: int, rngs: nnx.Rngs, patch_size: int, width: int,
               depth: int, num_heads: int, mlp_dim: int, image_size=224,
               head: str = "token", layerscale_init: float | None = None,
               qkv_bias: bool = True, drop_path_rate: float = 0.0,
               drop_path_schedule: str = "linear", pos_embed_cls: bool = True,
               dtype=jnp.float32, param_dtype=jnp.float32, head_zeroinit: bool = True,
               stochastic_depth: str = "mask", pre_logits: bool = False):
    if head not in ("token", "gap"):
      raise ValueError(f"head must be 'token' or 'gap', got {head!r}")
    h, w = _pair(image_size)
    if h < patch_size or w < patch_size:
      raise ValueError(f"image_size {image_size!r} is smaller than patch_size {patch_size}")
    # A size that is not a multiple of the patch size leaves its last rows and columns out,
    # as timm's and DeiT-III's PatchEmbed do (DeiT-III trains ViT-H/14 at 160 px: 11 x 11).
    self.num_classes = num_classes
    self.patch_size = patch_size
    self.image_size = (h, w)
    self.grid = (h // patch_size, w // patch_size)
    self.width = width
    self.depth = self.num_blocks = depth
    self.head_type = head
    self.pos_embed_cls = pos_embed_cls
    self.dtype = dtype
    self.drop_path_rates = layers.drop_path_rates(drop_path_rate, depth, drop_path_schedule)
    self.stochastic_depth = layers.check_stochastic_depth_mode(stochastic_depth)

    self.patch_embed = nnx.Conv(
        3, width, (patch_size, patch_size), strides=patch_size, padding="VALID",
        kernel_init=layers.partitioned(nnx.initializers.lecun_normal(),
                                       (None, None, None, "embed")),
        dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    num_tokens = self.grid[0] * self.grid[1]
    if head == "token":
      self.cls_token = nnx.Param(jnp.zeros((1, 1, width), param_dtype),
                                 out_sharding=(None, None, "embed"))
      if pos_embed_cls:
        num_tokens += 1
    else:
      self.cls_token = None
    self.pos_embed = nnx.Param(
        nnx.initializers.truncated_normal(0.02)(rngs.params(), (1, num_tokens, width),
                                                param_dtype),
        out_sharding=(None, None, "embed"))
    self.blocks = nnx.List([
        Block(width, num_heads, mlp_dim, qkv_bias=qkv_bias, layerscale_init=layerscale_init,
              drop_path_rate=rate, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
              stochastic_depth=stochastic_depth)
        for rate in self.drop_path_rates])
    self.norm = nnx.LayerNorm(width, epsilon=1e-6, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)
    # Like the head, the representation layer runs in float32 (one [B, D] x [D, D] matmul).
    self.pre_logits = nnx.Linear(
        width, width, kernel_init=layers.partitioned(nnx.initializers.lecun_normal(),
                                                     ("embed", None)),
        dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs) if pre_logits else None
    head_init = (nnx.initializers.zeros if head_zeroinit
                 else nnx.initializers.truncated_normal(0.02))
    # The head runs in float32 whatever the compute dtype: logits feed softmaxes over up to
    # ~11k-21k classes.
    self.head = layers.classifier_head(width, num_classes, param_dtype=param_dtype, rngs=rngs,
                                       kernel_init=head_init)

  def _tokens(self, images: jax.Array) -> jax.Array:
    if images.ndim != 4 or images.shape[1:3] != self.image_size or images.shape[3] != 3:
      raise ValueError(f"expected images [B, {self.image_size[0]}, {self.image_size[1]}, 3], "
                       f"got shape {images.shape}")
    x = self.patch_embed(images.astype(self.dtype))
    b = x.shape[0]
    x = x.reshape(b, -1, self.width)
    pos = self.pos_embed[...].astype(x.dtype)
    if self.cls_token is None:
      return x + pos
    cls = jnp.broadcast_to(self.cls_token[...].astype(x.dtype), (b, 1, self.width))
    if self.pos_embed_cls:
      return jnp.concatenate([cls, x], axis=1) + pos
    return jnp.concatenate([cls, x + pos], axis=1)

  def adapt_param(self, path: str, saved: jax.Array, method: str) -> jax.Array | None:
    """The position embedding of a square grid (plus the class token's row when this model
    gives it one, kept as it is) resized to this model's grid by `method`."""
    prefix = 1 if self.cls_token is not None and self.pos_embed_cls else 0
    old = math.isqrt(max(saved.shape[1] - prefix, 0)) if saved.ndim == 3 else 0
    if (path != "pos_embed" or not old or old * old != saved.shape[1] - prefix
        or saved.shape[::2] != (1, self.width)):
      return None
    return resize_pos_embed(saved, (old, old), self.grid, num_prefix=prefix, method=method)

  def effective_drop_path_rates(self, batch_size: int) -> list[float]:
    """Per-block drop rates training applies to a global batch of `batch_size` rows.

    The nominal rates for 'mask'; for 'esd' the rates after flooring the kept rows of each
    data shard under the current mesh (cosub supplement C.1), e.g. 0.5 -> 0.6 for 5 local rows.
    """
    if self.stochastic_depth == "mask":
      return list(self.drop_path_rates)
    shards = layers.data_shards()
    if batch_size % shards:
      raise ValueError(f"batch of {batch_size} rows does not split over {shards} data shards.")
    return [layers.esd_effective_rate(r, batch_size // shards) for r in self.drop_path_rates]

  def features(self, images: jax.Array, *, train: bool = False,
               rng: jax.Array | None = None) -> jax.Array:
    """Pooled, final-normed features [B, width] in float32 (the head's input: after the
    tanh representation layer when pre_logits=True)."""
    layers.check_rng(train, self.drop_path_rates, rng, "VisionTransformer")
    # Activations stay split by rows under FSDP (see layers.constrain_batch).
    x = layers.constrain_batch(self._tokens(images))
    # Padded once for every block when their attention kernel needs it (Attention.pad_to),
    # not in each block: the pad tokens only ever attend (they are no key), and are dropped.
    tokens = x.shape[1]
    pad_to = max((m.pad_to() for _, m in nnx.iter_graph(self.blocks)
                  if isinstance(m, Attention)), default=1)
    if tokens % pad_to:
      x = jnp.pad(x, ((0, 0), (0, -tokens % pad_to), (0, 0)))
    for i, block in enumerate(self.blocks):
      x = layers.constrain_batch(block(x, train=train, rng=layers.fold_rng(rng, i),
                                       tokens=tokens))
    x = self.norm(x[:, :tokens])
    x = x[:, 0] if self.head_type == "token" else jnp.mean(x, axis=1)
    x = layers.constrain_batch(x.astype(jnp.float32))
    return x if self.pre_logits is None else jnp.tanh(self.pre_logits(x))


# How a position embedding is resampled to a new grid: the bicubic resizes of the code bases
# checkpoints come from (torch's F.interpolate, mode="bicubic"):
# - bicubic_align_corners: align_corners=True; ClassyVision's VisionTransformer (the trainer
#   SWAG fine-tunes with) and torchvision's interpolate_embeddings.
# - bicubic: align_corners=False (half-pixel centres); DeiT / DeiT-III's fine-tuning at a new
#   resolution (the code base of cosub).
# - bicubic_antialias: half-pixel and antialias=True; timm's resample_abs_pos_embed default.
RESIZE_METHODS = ("bicubic_align_corners", "bicubic", "bicubic_antialias")
# The resize of the library a converted checkpoint came from (bigpretrain/models/convert.py sources).
ORIGIN_RESIZE = {"torchvision": "bicubic_align_corners", "timm": "bicubic_antialias"}


def _cubic(x: np.ndarray, a: float) -> np.ndarray:
  """Keys' cubic convolution kernel with coefficient `a` (torch: -0.75; antialiased and PIL:
  -0.5)."""
  x = np.abs(x)
  near = ((a + 2) * x - (a + 3)) * x * x + 1
  far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
  return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def resize_matrix(old: int, new: int, method: str) -> np.ndarray:
  """The [new, old] matrix of one axis's resampling by `method` (RESIZE_METHODS), as torch's
  upsample_bicubic2d (four taps, indices clamped at the border) or, antialiased, its
  _upsample_bicubic2d_aa (taps widened by the scale when shrinking, weights renormalised)."""
  if method not in RESIZE_METHODS:
    raise ValueError(f"position-embedding resize method {method!r} must be one of "
                     f"{RESIZE_METHODS}.")
  out = np.zeros((new, old), np.float64)
  if method == "bicubic_antialias":
    scale = old / new
    support, stretch = 2.0 * max(scale, 1.0), max(scale, 1.0)
    for i in range(new):
      centre = scale * (i + 0.5)
      lo, hi = max(int(centre - support + 0.5), 0), min(int(centre + support + 0.5), old)
      taps = np.arange(lo, hi)
      weights = _cubic((taps - centre + 0.5) / stretch, -0.5)
      out[i, taps] = weights / weights.sum()
    return out
  for i in range(new):
    if method == "bicubic_align_corners":
      src = i * (old - 1) / (new - 1) if new > 1 else 0.0
    else:
      src = (i + 0.5) * old / new - 0.5
    base = math.floor(src)
    for k in range(-1, 3):
      out[i, min(max(base + k, 0), old - 1)] += _cubic(np.float64(src - base - k), -0.75)
  return out


def resize_pos_embed(pos_embed: jax.Array, old_grid: tuple[int, int],
                     new_grid: tuple[int, int], num_prefix: int = 0,
                     method: str = "bicubic") -> jax.Array:
  """Resizes a [1, prefix + gh*gw, D] position embedding for a new resolution by `method`
  (RESIZE_METHODS), separably along the grid's rows and columns. The first `num_prefix`
  rows (the class token's, when it has one) are kept as they are."""
  pos_embed = jnp.asarray(pos_embed, jnp.float32)
  d = pos_embed.shape[-1]
  prefix, grid = pos_embed[:, :num_prefix], pos_embed[:, num_prefix:]
  grid = grid.reshape(old_grid[0], old_grid[1], d)
  rows = jnp.asarray(resize_matrix(old_grid[0], new_grid[0], method), jnp.float32)
  cols = jnp.asarray(resize_matrix(old_grid[1], new_grid[1], method), jnp.float32)
  grid = jnp.einsum("ih,jw,hwd->ijd", rows, cols, grid, precision="highest")
  return jnp.concatenate([prefix, grid.reshape(1, -1, d)], axis=1)


def _variants() -> dict:
  out = {}
  for size, (width, depth, heads, mlp_dim) in _SIZES.items():
    for patch in _PATCHES:
      out[f"vit_{size}{patch}"] = functools.partial(
          VisionTransformer, patch_size=patch, width=width, depth=depth, num_heads=heads,
          mlp_dim=mlp_dim)
  out["vit_demo"] = vit_demo
  return out


def vit_demo(*, num_classes: int, rngs: nnx.Rngs, image_size=32, **kw) -> VisionTransformer:
  """Small ViT for the CPU demo configs: patch 8, width 128, depth 4, 4 heads, MLP 256."""
  return VisionTransformer(num_classes=num_classes, rngs=rngs, patch_size=8, width=128,
                           depth=4, num_heads=4, mlp_dim=256, image_size=image_size, **kw)


VARIANTS = _variants()

for _name, _factory in sorted(VARIANTS.items()):
  base.MODELS.register(_name, _factory)
