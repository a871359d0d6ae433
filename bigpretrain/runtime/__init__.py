"""Run-time services of a training run, none of them about what is trained.

goodput.py        where a run's time goes ('perf/...' metrics, profiler window)
preemption.py     SIGTERM: every process saves the same step, then exits 0
distributed.py    one `jax.distributed.initialize` for TPU pods, SLURM and flags
workdir_lock.py   one trainer per workdir
out_paths.py      a command's output folder or file, checked before its work
metric_writers.py metrics.jsonl, TensorBoard and the progress bar
console.py        the one channel for what a run tells its user
cache.py          the cache folder (WordNet files, demo dataset, compilation cache)
transient.py      errors of the storage, network or memory, not of the data read
units.py          byte counts in messages
tracer_sharding.py JAX's Tracer.sharding without its quadratic origin message (NNX tracing)
"""
