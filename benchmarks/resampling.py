"""SWAG head/tail resampling sampler speed and memory over many images: one JSON line.

  python benchmarks/resampling.py [--images=10000000] [--hashtags=27000] \
      [--tail_threshold=5000] [--alpha=0.7] [--batch_size=1024]

Synthetic dataset: each of --images images holds one canonical hashtag drawn from a Zipf
law (exponent 1) over --hashtags hashtags, like Figure 1's long tail; importance and tail
flags follow bigpretrain.swag.resampling.importance (f^-1/2, tail below the threshold),
computed here with numpy directly since 10M Python label lists would only time Python.
`importance()` itself is timed on the first --importance_images images.

Measured: building ResampledIndices with epochs of 1.4 x --images samples (IG-3.6B: ~5B
samples per epoch over 3.6B images; build_s, its arrays' size sampler_mb); scalar access
sampler[j], the way the input pipeline reads it one record at a time (images_per_sec =
samples/s; step_time_ms = one --batch_size batch of scalar reads); vectorised access on
arrays of --batch_size ids (batched_samples_per_sec); peak_rss_mb of the process. With
--hosts=P > 1, also host 0's per-host sampler (resampling.host_sampler's layout: its
contiguous 1/P of the images, its share of the epoch; host_sampler_mb, host_build_s).
"""
import json
import resource
import sys
import time

from absl import app
from absl import flags
import numpy as np

from bigpretrain.swag import resampling

_IMAGES = flags.DEFINE_integer("images", 10_000_000, "Synthetic images.")
_HASHTAGS = flags.DEFINE_integer("hashtags", 27_000, "Canonical hashtags (paper: ~27k).")
_THRESHOLD = flags.DEFINE_integer("tail_threshold", 5000, "Head: hashtags in >= this many "
                                  "images (paper: 5,000).")
_ALPHA = flags.DEFINE_float("alpha", 0.7, "Head share of an epoch (paper: 0.7).")
_BATCH = flags.DEFINE_integer("batch_size", 1024, "Ids per vectorised call / timed batch.")
_SCALAR_DRAWS = flags.DEFINE_integer("scalar_draws", 100_000, "Timed scalar reads.")
_BATCHED_DRAWS = flags.DEFINE_integer("batched_draws", 4_000_000, "Timed vectorised reads.")
_HOSTS = flags.DEFINE_integer("hosts", 16, "Hosts for the per-host sampler figures (paper: "
                              "16 nodes).")
_IMPORTANCE_IMAGES = flags.DEFINE_integer("importance_images", 1_000_000,
                                          "Images for timing importance() on label lists.")


def synthetic(num_images: int, num_hashtags: int, seed: int = 0) -> np.ndarray:
  """One Zipf-distributed hashtag id per image."""
  p = 1.0 / np.arange(1, num_hashtags + 1)
  return np.random.default_rng(seed).choice(num_hashtags, num_images, p=p / p.sum())


def main(argv):
  del argv
  labels = synthetic(_IMAGES.value, _HASHTAGS.value)
  freq = np.bincount(labels, minlength=_HASHTAGS.value)[labels]
  importance, is_tail = freq.astype(np.float64) ** -0.5, freq < _THRESHOLD.value

  lists = labels[:_IMPORTANCE_IMAGES.value, None].tolist()
  t0 = time.perf_counter()
  resampling.importance(lists, _THRESHOLD.value)
  importance_s = time.perf_counter() - t0
  del lists

  t0 = time.perf_counter()
  sampler = resampling.ResampledIndices(importance, is_tail, alpha=_ALPHA.value,
                                        num_samples=14 * _IMAGES.value // 10, seed=0)
  build_s = time.perf_counter() - t0
  sampler_mb = sum(g.indices.nbytes + g.cdf.nbytes
                   for g in (sampler._head, sampler._tail)) / 2**20  # pylint: disable=protected-access

  host_mb = host_build_s = None
  if _HOSTS.value > 1:
    start, stop = resampling.host_slice(_IMAGES.value, 0, _HOSTS.value)
    t0 = time.perf_counter()
    host = resampling.ResampledIndices(
        importance[start:stop], is_tail[start:stop], alpha=_ALPHA.value,
        num_samples=resampling.host_share(14 * _IMAGES.value // 10, 0, _HOSTS.value), seed=0,
        stream=0, offset=start)
    host_build_s = round(time.perf_counter() - t0, 3)
    host_mb = round(sum(g.indices.nbytes + g.cdf.nbytes
                        for g in (host._head, host._tail)) / 2**20, 1)  # pylint: disable=protected-access
    del host

  n = _SCALAR_DRAWS.value
  t0 = time.perf_counter()
  for j in range(n):
    sampler[j]  # pylint: disable=pointless-statement
  scalar_s = (time.perf_counter() - t0) / n

  ids = np.arange(_BATCHED_DRAWS.value)
  t0 = time.perf_counter()
  drawn = [sampler[ids[i:i + _BATCH.value]] for i in range(0, len(ids), _BATCH.value)]
  batched_s = (time.perf_counter() - t0) / len(ids)
  drawn = np.concatenate(drawn)

  print(json.dumps({
      "benchmark": "resampling",
      "images": _IMAGES.value, "hashtags": _HASHTAGS.value,
      "tail_images": int(is_tail.sum()), "alpha": _ALPHA.value,
      "head_share_drawn": round(float((~is_tail[drawn]).mean()), 4),
      "unique_drawn": int(np.unique(drawn).size), "drawn": int(drawn.size),
      "importance_s_per_1m_images": round(importance_s * 1e6 / _IMPORTANCE_IMAGES.value, 2),
      "build_s": round(build_s, 3), "sampler_mb": round(sampler_mb, 1),
      "hosts": _HOSTS.value, "host_build_s": host_build_s, "host_sampler_mb": host_mb,
      "images_per_sec": round(1 / scalar_s), "batch_size": _BATCH.value,
      "step_time_ms": round(1e3 * scalar_s * _BATCH.value, 2),
      "batched_samples_per_sec": round(1 / batched_s),
      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
  }))


if __name__ == "__main__":
  sys.exit(app.run(main))
