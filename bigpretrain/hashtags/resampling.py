"""SWAG head/tail resampling (Singh et al. 2022, section 3.1 and appendix A "Image Sampling").

A canonical hashtag h seen in f(h) images has importance I_h = f(h)^-1/2; an image has the
largest importance of its hashtags. Hashtags in at least `tail_threshold` images (5,000 in the
paper) are the head, the rest the tail; an image is a tail image iff it has a tail hashtag. An
epoch of M samples takes alpha * M samples from the head images and (1 - alpha) * M from the
tail images (alpha = 0.7 in the paper), each drawn independently with probability
proportional to I_i, with replacement.

ResampledIndices is that epoch as a random-access index sampler: sample j is a pure function of
(seed, j), so a data iterator that checkpoints its position resumes exactly, hosts draw their
own shares without talking to each other, and no list of M indices is ever built (M is
billions in the paper). Memory is the per-group cumulative importance: 12 bytes per image
below 2^31 images, 16 above, on every host, since each host reads the one global stream
(for_host); that is O(all images), not O(images per host).

How sample j is drawn (epoch e = j // M, position r = j % M):
- head or tail: a keyed pseudo-random permutation pi_e of [0, M) (a Feistel network with
  cycle walking) sends r to pi_e(r), and the sample is a head sample iff
  pi_e(r) < round(alpha * M). Every epoch thus has exactly round(alpha * M) head samples, spread
  at random over its positions: a fixed pattern such as "head iff floor((j + 1) alpha) >
  floor(j alpha)" repeats with a short period (10 for alpha = 0.7) and would give some hosts
  (host p reads j = k P + p) only head or only tail samples.
- which image: u = the j-th output of a SplitMix64 stream keyed by the seed, a uniform in
  [0, 1), looked up in the group's normalised cumulative importance (inverse CDF, as
  numpy.random.Generator.choice does).
"""
import itertools
from typing import Sequence

import numpy as np

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2^64 / golden ratio.
_FEISTEL_ROUNDS = 4  # Luby-Rackoff: 4 rounds make a strong pseudo-random permutation.
_MAX_SAMPLES = 1 << 62  # Permutation domains and sample ids stay far below 2^64.

# The helpers below take a Python int or a uint64 array alike (numpy wraps uint64 arrays
# silently; Python ints are masked), so one code path serves [j] and [array of j].


def _mix64(x):
  """SplitMix64's output function: a bijection of 64-bit words with full avalanche."""
  x = x & _MASK64
  x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
  x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
  return x ^ (x >> 31)


def _uniform(key: int, j):
  """Output j of the SplitMix64 stream with state `key`, as 53 random bits in [0, 1)."""
  return (_mix64(key + (j + 1) * _GOLDEN) >> 11) * 2.0**-53


def _feistel(x, keys, half: int):
  """A keyed bijection of [0, 4^half): a balanced Feistel network."""
  mask = (1 << half) - 1
  left, right = x >> half, x & mask
  for k in keys:
    left, right = right, left ^ (_mix64(right ^ k) & mask)
  return (left << half) | right


def _check_int(name: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
  return int(value)


def importance(label_lists: Sequence[Sequence[int]],
               tail_threshold: int) -> tuple[np.ndarray, np.ndarray]:
  """Per-image importance max_h f(h)^-1/2 (float64 [N]) and tail flag (bool [N]).

  Args:
    label_lists: N sequences of canonical label ids (ints >= 0), one per image; a label
      repeated within an image counts once. Every image needs at least one label (the
      dataset job drops images left without one).
    tail_threshold: hashtags in at least this many images are the head (paper: 5,000).
  """
  tail_threshold = _check_int("tail_threshold", tail_threshold, 0)
  n = len(label_lists)
  if n == 0:
    raise ValueError("label_lists is empty: no images to resample")
  lengths = np.fromiter((len(labels) for labels in label_lists), np.int64, n)
  if not lengths.all():
    empty = np.flatnonzero(lengths == 0)
    raise ValueError(f"{empty.size} images have no labels (first: image {empty[0]}); drop "
                     "them before resampling")
  labels = np.asarray(list(itertools.chain.from_iterable(label_lists)))
  if labels.dtype.kind not in "iu":
    raise ValueError(f"label ids must be ints, got {labels.dtype} values")
  if labels.min() < 0:
    raise ValueError(f"label ids must be >= 0 (-1 padding left in?), got {labels.min()}")
  uniq, label = np.unique(labels, return_inverse=True)  # Compact ids 0..L-1.
  image = np.repeat(np.arange(n, dtype=np.int64), lengths)
  pairs = np.unique(image * len(uniq) + label)  # Distinct (image, label), sorted by image.
  pair_image, pair_label = np.divmod(pairs, len(uniq))
  freq = np.bincount(pair_label, minlength=len(uniq))  # f(h): images holding h.
  starts = np.concatenate([[0], np.cumsum(np.bincount(pair_image, minlength=n))[:-1]])
  rarest = np.minimum.reduceat(freq[pair_label], starts)  # Max I_h is at the min f(h).
  return rarest.astype(np.float64) ** -0.5, rarest < tail_threshold


class _Group:
  """Images of one group (head or tail) with their normalised cumulative importance."""

  def __init__(self, name: str, mask: np.ndarray, weights: np.ndarray):
    index_dtype = np.int32 if len(mask) < 2**31 else np.int64
    self.indices = np.flatnonzero(mask).astype(index_dtype)
    self.cdf = np.cumsum(weights[self.indices])
    if not self.cdf.size or self.cdf[-1] <= 0:
      raise ValueError(f"no {name} images with positive importance to draw from")
    self.cdf /= self.cdf[-1]  # Exactly 1.0 at the end, so u < 1 never runs off the end.

  def draw(self, u):
    """Image indices for uniforms u in [0, 1) (a float or an array)."""
    if np.ndim(u) == 0:
      return self.indices[np.searchsorted(self.cdf, u, side="right")]
    # Sorted queries walk the cdf in order: far fewer cache misses when it is large.
    order = np.argsort(u)
    out = np.empty(u.shape, self.indices.dtype)
    out[order] = self.indices[np.searchsorted(self.cdf, u[order], side="right")]
    return out


class ResampledIndices:
  """Epochs of `num_samples` head/tail resampled image indices; [j] -> image of sample j.

  `len()` is one epoch; indices past it continue into later epochs (epoch j // num_samples
  gets its own draw), which is how an infinite training stream reads it. `[j]` takes an int
  or an int array (vectorised). Iterating yields one epoch.
  """

  def __init__(self, importance: np.ndarray, is_tail: np.ndarray, *, alpha: float,
               num_samples: int, seed: int):
    weights = np.asarray(importance, np.float64)
    is_tail = np.asarray(is_tail)
    if weights.ndim != 1 or not weights.size:
      raise ValueError(f"importance must be a non-empty 1-D array, got shape {weights.shape}")
    if is_tail.shape != weights.shape or is_tail.dtype != np.bool_:
      raise ValueError(f"is_tail must be a bool array of shape {weights.shape}, got "
                       f"{is_tail.dtype} {is_tail.shape}")
    if not (np.isfinite(weights).all() and (weights >= 0).all()):
      raise ValueError("importance must be finite and >= 0")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating)) or not (
        0.0 <= alpha <= 1.0):
      raise ValueError(f"alpha (the head share) must be in [0, 1], got {alpha!r}")
    self.num_samples = _check_int("num_samples", num_samples, 1)
    if self.num_samples > _MAX_SAMPLES:
      raise ValueError(f"num_samples must be <= 2^62, got {num_samples}")
    self.seed = _check_int("seed", seed, 0)
    if self.seed >= 2**64:
      raise ValueError(f"seed must be < 2^64, got {seed}")
    self.alpha = float(alpha)
    self.num_head_samples = round(self.alpha * self.num_samples)  # Per epoch, exactly.
    try:
      self._head = _Group("head", ~is_tail, weights) if self.alpha > 0 else None
      self._tail = _Group("tail", is_tail, weights) if self.alpha < 1 else None
    except ValueError as e:
      raise ValueError(f"{e} (alpha={self.alpha}: a head share of 0 needs no head images, "
                       "1 no tail images)") from None
    self._draw_key = _mix64(_mix64(self.seed) + 1)  # One key per stream of randomness.
    self._perm_key = _mix64(_mix64(self.seed) + 2)
    bits = max(2, (self.num_samples - 1).bit_length())  # 2^bits >= M.
    self._half = (bits + 1) // 2  # The permuted domain [0, 4^half) is [M, 4 M).
    self._last_keys = (-1, [])

  def __len__(self) -> int:
    return self.num_samples

  def __iter__(self):
    for j in range(self.num_samples):
      yield self[j]

  def __getitem__(self, j):
    if isinstance(j, (int, np.integer)) and not isinstance(j, bool):
      j = int(j)
      if not 0 <= j < _MAX_SAMPLES:
        raise IndexError(f"sample id must be in [0, 2^62), got {j}")
      u = _uniform(self._draw_key, j)
      return int((self._head if self._is_head(j) else self._tail).draw(u))
    j = np.asarray(j)
    if j.dtype.kind not in "iu":
      raise TypeError(f"sample ids must be ints, got {j.dtype}")
    if j.size and (j.min() < 0 or j.max() >= _MAX_SAMPLES):
      raise IndexError(f"sample ids must be in [0, 2^62), got {j.min()}..{j.max()}")
    shape, j = j.shape, j.reshape(-1).astype(np.uint64)
    u = _uniform(self._draw_key, j)
    head = self._is_head(j)
    out = np.empty(j.shape, (self._head or self._tail).indices.dtype)
    for group, rows in ((self._head, head), (self._tail, ~head)):
      if group is not None:
        out[rows] = group.draw(u[rows])
    return out.reshape(shape)

  def for_host(self, process_index: int, process_count: int) -> "HostIndices":
    """This host's view of the global sample stream: its j-th record is sample
    j * process_count + process_index (what the pipeline's per-host sampler hook needs)."""
    return HostIndices(self, process_index, process_count)

  def _round_keys(self, epoch):
    """Feistel round keys of an epoch (int or uint64 array); the last int epoch's are kept."""
    if isinstance(epoch, int) and self._last_keys[0] == epoch:
      return self._last_keys[1]
    keys = [_mix64(self._perm_key ^ (epoch * _FEISTEL_ROUNDS + k))
            for k in range(_FEISTEL_ROUNDS)]
    if isinstance(epoch, int):
      self._last_keys = (epoch, keys)
    return keys

  def _is_head(self, j):
    """Whether sample j (int or uint64 array) is a head sample: pi_e(j % M) < round(alpha M)."""
    if self._tail is None or self._head is None:
      return self._tail is None if isinstance(j, int) else np.full(j.shape, self._tail is None)
    epoch, r = divmod(j, self.num_samples)
    keys = self._round_keys(epoch)
    # Cycle walking: re-apply the permutation of [0, 4^half) until the value is in [0, M);
    # 4^half < 4 M, so under 4 rounds on average.
    out = _feistel(r, keys, self._half)
    if isinstance(j, int):
      while out >= self.num_samples:
        out = _feistel(out, keys, self._half)
      return out < self.num_head_samples
    outside = np.flatnonzero(out >= self.num_samples)
    while outside.size:
      out[outside] = _feistel(out[outside], [k[outside] for k in keys], self._half)
      outside = outside[out[outside] >= self.num_samples]
    return out < self.num_head_samples


class HostIndices:
  """Host `process_index`'s share of a ResampledIndices stream: [j] is global sample
  j * process_count + process_index; len() is its share of the first epoch."""

  def __init__(self, sampler: ResampledIndices, process_index: int, process_count: int):
    self.process_count = _check_int("process_count", process_count, 1)
    self.process_index = _check_int("process_index", process_index, 0)
    if self.process_index >= self.process_count:
      raise ValueError(f"process_index {process_index} must be < process_count "
                       f"{process_count}")
    self.sampler = sampler

  def __len__(self) -> int:
    return len(range(self.process_index, self.sampler.num_samples, self.process_count))

  def __iter__(self):
    for j in range(len(self)):
      yield self[j]

  def __getitem__(self, j):
    if isinstance(j, (int, np.integer)) and not isinstance(j, bool):
      if j < 0:
        raise IndexError(f"sample ids must be >= 0, got {j}")
      return self.sampler[int(j) * self.process_count + self.process_index]
    j = np.asarray(j)
    if j.dtype.kind not in "iu":
      raise TypeError(f"sample ids must be ints, got {j.dtype}")
    return self.sampler[j.astype(np.int64) * self.process_count + self.process_index]
