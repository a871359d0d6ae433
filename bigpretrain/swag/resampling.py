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
below 2^31 images, 16 above.

Two ways to split the epoch over P hosts:
- for_host(p, P): host p reads global samples p, p + P, ...: the exact global draw, but every
  host holds the cumulative importance of ALL images (O(all images) per host).
- host_sampler(...): host p owns the contiguous image slice host_slice(N, p, P) and draws its
  host_share(M, p, P) samples from that slice alone (its own alpha head / tail split, its own
  key stream `stream=p`, image indices offset to the slice), from importance computed on the
  slice with the global hashtag counts (importance(..., label_counts=)): memory
  O(images per host). What changes statistically: the draw is stratified by host. Image i of
  slice s is drawn with probability (M_s / M) I_i / W_s (W_s: the importance mass of i's
  group in s) instead of I_i / W; the two agree when every slice holds a 1/P share of the head
  and of the tail importance, which a shuffled dataset meets up to the slice sums' sampling
  noise (relative ~ 1/sqrt(images per slice)); a host whose slice has no head (or no tail)
  image is an error. Each host still draws exactly round(alpha * M_s) head samples per epoch.

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
from typing import NamedTuple, Sequence

from absl import logging
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


class Labels(NamedTuple):
  """N images' label ids, flat: image i holds ids[offsets[i]:offsets[i + 1]] (the layout of a
  hashtag dataset's label index, read without a Python object per image)."""
  ids: np.ndarray
  offsets: np.ndarray  # int [N + 1], offsets[0] = 0.

  @classmethod
  def of(cls, label_lists: "Labels | Sequence[Sequence[int]]") -> "Labels":
    """`label_lists` as Labels (one sequence of ids per image), or as it is if it is one."""
    if isinstance(label_lists, Labels):
      return label_lists
    lengths = np.fromiter((len(labels) for labels in label_lists), np.int64, len(label_lists))
    ids = np.asarray(list(itertools.chain.from_iterable(label_lists)))
    return cls(ids, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))

  def __len__(self) -> int:
    return len(self.offsets) - 1


def importance(label_lists: Labels | Sequence[Sequence[int]], tail_threshold: int, *,
               label_counts=None) -> tuple[np.ndarray, np.ndarray]:
  """Per-image importance max_h f(h)^-1/2 (float64 [N]) and tail flag (bool [N]).

  Args:
    label_lists: N sequences of canonical label ids (ints >= 0), one per image, or Labels; a
      label repeated within an image counts once. Every image needs at least one label (the
      dataset job drops images left without one).
    tail_threshold: hashtags in at least this many images are the head (paper: 5,000).
    label_counts: f(h) of every label id (int [L], images holding it in the whole dataset),
      for a host that reads only its slice of the images; None counts f(h) in label_lists.
  """
  tail_threshold = _check_int("tail_threshold", tail_threshold, 0)
  flat = Labels.of(label_lists)
  n = len(flat)
  if n == 0:
    raise ValueError("label_lists is empty: no images to resample")
  lengths = np.diff(flat.offsets)
  if not lengths.all():
    empty = np.flatnonzero(lengths == 0)
    raise ValueError(f"{empty.size} images have no labels (first: image {empty[0]}); drop "
                     "them before resampling")
  labels = np.asarray(flat.ids)
  if labels.dtype.kind not in "iu":
    raise ValueError(f"label ids must be ints, got {labels.dtype} values")
  if labels.min() < 0:
    raise ValueError(f"label ids must be >= 0 (-1 padding left in?), got {labels.min()}")
  uniq, label = np.unique(labels, return_inverse=True)  # Compact ids 0..L-1.
  image = np.repeat(np.arange(n, dtype=np.int64), lengths)
  pairs = np.unique(image * len(uniq) + label)  # Distinct (image, label), sorted by image.
  pair_image, pair_label = np.divmod(pairs, len(uniq))
  if label_counts is None:
    freq = np.bincount(pair_label, minlength=len(uniq))  # f(h): images holding h.
  else:
    counts = np.asarray(label_counts)
    if counts.ndim != 1 or counts.dtype.kind not in "iu":
      raise ValueError(f"label_counts must be a 1-D int array, got {counts.dtype} "
                       f"{counts.shape}")
    if uniq[-1] >= counts.size:
      raise ValueError(f"label id {uniq[-1]} has no entry in label_counts (size {counts.size})")
    freq = counts[uniq]
    seen = np.bincount(pair_label, minlength=len(uniq))
    if (freq < seen).any():
      bad = uniq[np.argmax(freq < seen)]
      raise ValueError(f"label_counts[{bad}] = {counts[bad]} is below the {seen[freq < seen][0]} "
                       "images holding it here: label_counts must count the whole dataset")
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
               num_samples: int, seed: int, stream: int = 0, offset: int = 0,
               log_epochs: bool = False):
    """`stream` selects an independent key stream for the same seed (one per host in
    host_sampler); `offset` is added to every image index drawn (the first image of a host's
    slice); `log_epochs` logs epoch_stats when the last sample of an epoch is read."""
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
    self.stream = _check_int("stream", stream, 0)
    self.offset = _check_int("offset", offset, 0)
    self.log_epochs = bool(log_epochs)
    base = _mix64(self.seed) + 4 * self.stream * _GOLDEN  # Stream 0: the seed's own keys.
    self._draw_key = _mix64(base + 1)  # One key per source of randomness.
    self._perm_key = _mix64(base + 2)
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
      if self.log_epochs and j % self.num_samples == self.num_samples - 1:
        self._log_epoch(j // self.num_samples)
      return int((self._head if self._is_head(j) else self._tail).draw(u)) + self.offset
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
    if self.log_epochs:
      for epoch in np.unique(j[j % self.num_samples == self.num_samples - 1]):
        self._log_epoch(int(epoch) // self.num_samples)
    if self.offset:
      out = out.astype(np.int64) + self.offset
    return out.reshape(shape)

  def epoch_stats(self, epoch: int, chunk: int = 1 << 20) -> dict:
    """{'epoch', 'samples', 'unique_images', 'head_share'} of one epoch, by drawing it again
    in chunks: O(num_samples) time, O(images) memory (a flag per image of the sampler)."""
    epoch = _check_int("epoch", epoch, 0)
    groups = [g for g in (self._head, self._tail) if g is not None]
    num_images = max(int(g.indices[-1]) for g in groups) + 1
    seen = np.zeros(num_images, bool)
    head = 0
    start = epoch * self.num_samples
    for a in range(start, start + self.num_samples, chunk):
      j = np.arange(a, min(a + chunk, start + self.num_samples), dtype=np.uint64)
      is_head = self._is_head(j)
      head += int(np.count_nonzero(is_head))
      u = _uniform(self._draw_key, j)
      for group, rows in ((self._head, is_head), (self._tail, ~is_head)):
        if group is not None and rows.any():
          seen[group.draw(u[rows])] = True
    return {"epoch": epoch, "samples": self.num_samples,
            "unique_images": int(np.count_nonzero(seen)),
            "head_share": head / self.num_samples}

  def _log_epoch(self, epoch: int) -> None:
    stats = self.epoch_stats(epoch)
    logging.info("Resampling (seed %d, stream %d) epoch %d: %d samples, %d unique images, "
                 "head share %.4f", self.seed, self.stream, epoch, stats["samples"],
                 stats["unique_images"], stats["head_share"])

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


def host_slice(num_images: int, process_index: int, process_count: int) -> tuple[int, int]:
  """[start, stop) of the images host `process_index` owns: contiguous, sizes within one."""
  num_images = _check_int("num_images", num_images, 1)
  process_count = _check_int("process_count", process_count, 1)
  process_index = _check_int("process_index", process_index, 0)
  if process_index >= process_count:
    raise ValueError(f"process_index {process_index} must be < process_count {process_count}")
  if num_images < process_count:
    raise ValueError(f"{num_images} images cannot give each of {process_count} hosts a slice")
  return (process_index * num_images // process_count,
          (process_index + 1) * num_images // process_count)


def host_share(num_samples: int, process_index: int, process_count: int) -> int:
  """Host p's samples of an epoch of num_samples: len(range(p, M, P)) (they sum to M)."""
  return len(range(process_index, num_samples, process_count))


def host_sampler(label_lists: Labels | Sequence[Sequence[int]], *, num_images: int,
                 label_counts, tail_threshold: int, alpha: float, num_samples: int, seed: int,
                 process_index: int, process_count: int,
                 log_epochs: bool = False) -> ResampledIndices:
  """Host p's resampler over its own image slice (see the module doc: memory O(images per
  host), draws stratified by host); it returns dataset image indices.

  Args:
    label_lists: the label ids of this host's images only, images host_slice(num_images,
      p, P) of the dataset, in order.
    num_images: N, the images of the whole dataset.
    label_counts: f(h) over the whole dataset (int [L]), e.g. the vocabulary's image counts.
    num_samples: the GLOBAL epoch length M; this host draws host_share(M, p, P) of it.
    Others: as ResampledIndices (the host's key stream is `stream=process_index`).
  """
  start, stop = host_slice(num_images, process_index, process_count)
  if len(label_lists) != stop - start:
    raise ValueError(f"host {process_index} of {process_count} owns images [{start}, {stop}) "
                     f"of {num_images}, but got label lists for {len(label_lists)} images")
  share = host_share(_check_int("num_samples", num_samples, 1), process_index, process_count)
  if share < 1:
    raise ValueError(f"an epoch of {num_samples} samples leaves host {process_index} of "
                     f"{process_count} none")
  weights, is_tail = importance(label_lists, tail_threshold, label_counts=label_counts)
  try:
    return ResampledIndices(weights, is_tail, alpha=alpha, num_samples=share, seed=seed,
                            stream=process_index, offset=start, log_epochs=log_epochs)
  except ValueError as e:
    raise ValueError(f"host {process_index} of {process_count}: {e}") from None
