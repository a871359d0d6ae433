"""The kernels' memory traffic read off optimized HLO (bigpretrain/plan/hlo_traffic.py): bytes
by hand on a written module, then on XLA:CPU's own compile of a known function."""
import jax
import jax.numpy as jnp
import pytest

from bigpretrain.plan import hlo_traffic

_MODULE = """
HloModule m, entry_computation_layout={(bf16[64,128]{1,0}, bf16[128,256]{1,0})->f32[64,256]{1,0}}

%fused_scale (param_0: bf16[64,256]) -> f32[64,256] {
  %param_0 = bf16[64,256]{1,0} parameter(0)
  ROOT %convert = f32[64,256]{1,0} convert(%param_0)
}

%body (p: (s32[], f32[64,256])) -> (s32[], f32[64,256]) {
  %p = (s32[], f32[64,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64,256]{1,0} get-tuple-element(%p), index=1
  %step = f32[64,256]{1,0} fusion(%x), kind=kLoop, calls=%fused_step
  ROOT %t = (s32[], f32[64,256]{1,0}) tuple(%i, %step)
}

%cond (p: (s32[], f32[64,256])) -> pred[] {
  %p = (s32[], f32[64,256]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%small (a: f32[64,256]) -> f32[64,256] {
  %a = f32[64,256]{1,0} parameter(0)
  ROOT %n = f32[64,256]{1,0} copy(%a)
}

%large (a: f32[64,256]) -> f32[64,256] {
  %a = f32[64,256]{1,0} parameter(0)
  %n1 = f32[64,256]{1,0} copy(%a)
  ROOT %n2 = f32[64,256]{1,0} copy(%n1)
}

ENTRY %main (x: bf16[64,128], w: bf16[128,256]) -> f32[64,256] {
  %x = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,256]{1,0} parameter(1)
  %gemm = (bf16[64,256]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(f)/dot_general"}
  %y = bf16[64,256]{1,0} get-tuple-element(%gemm), index=0
  %yb = bf16[64,256]{1,0} bitcast(%y)
  %f = f32[64,256]{1,0} fusion(%yb), kind=kLoop, calls=%fused_scale
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,256]{1,0}) tuple(%zero, %f)
  %loop = (s32[], f32[64,256]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %again = (s32[], f32[64,256]{1,0}) while(%loop), condition=%cond, body=%body
  %z = f32[64,256]{1,0} get-tuple-element(%again), index=1
  %sum = f32[64,256]{1,0} all-reduce(%z), replica_groups={}, to_apply=%add
  %pick = pred[] constant(true)
  %branch = f32[64,256]{1,0} conditional(%pick, %sum, %sum), true_computation=%small, false_computation=%large
  ROOT %out = f32[64,256]{1,0} copy(%branch)
}
"""
_X, _W = 64 * 128 * 2, 128 * 256 * 2
_Y16, _Y32 = 64 * 256 * 2, 64 * 256 * 4


def test_kernel_bytes_by_hand():
  t = hlo_traffic.traffic(_MODULE)
  # The GEMM reads x and w and writes y, not its workspace.
  assert t.kernels["matmul"] == 1 and t.bytes["matmul"] == _X + _W + _Y16
  # Memory kernels: the convert fusion; the loop body's fusion 3 times, then once (no trip
  # count); the conditional's larger branch (two copies); the final copy. Not the
  # all-reduce, tuples, bitcasts or get-tuple-elements.
  assert t.kernels["memory"] == 1 + 3 + 1 + 2 + 1
  assert t.bytes["memory"] == (_Y16 + _Y32) + 4 * (2 * _Y32) + 2 * (2 * _Y32) + 2 * _Y32
  assert t.unknown_trip_counts == 1
  found, unknown = hlo_traffic.kernels(_MODULE)  # Each kernel with its runs per step.
  assert [(k.name, k.kind, k.runs) for k in found] == [
      ("gemm", "matmul", 1), ("f", "memory", 1), ("step", "memory", 3), ("step", "memory", 1),
      ("n1", "memory", 1), ("n2", "memory", 1), ("out", "memory", 1)]
  assert found[0].op_name == "jit(f)/dot_general" and unknown == 1


def test_bound_takes_products_at_peak_and_the_rest_at_bandwidth():
  t = hlo_traffic.traffic(_MODULE)
  b = hlo_traffic.bound(t, flops=2 * 64 * 128 * 256, peak_flops=1e12, hbm_bandwidth=1e9)
  matmul = max(2 * 64 * 128 * 256 / 1e12, t.bytes["matmul"] / 1e9)  # Memory-bound here.
  assert b["matmul_seconds"] == pytest.approx(t.bytes["matmul"] / 1e9) == matmul
  assert b["bound_seconds"] == pytest.approx(matmul + t.bytes["memory"] / 1e9)
  assert b["mfu_at_bound"] == pytest.approx(2 * 64 * 128 * 256 / (b["bound_seconds"] * 1e12))
  # Kernels computing 1e12 FLOPs take a second at this peak; MFU still counts the model's.
  w = hlo_traffic.bound(t, flops=2 * 64 * 128 * 256, peak_flops=1e12, hbm_bandwidth=1e9,
                        work_flops=1e12)
  assert w["matmul_seconds"] == 1.0
  assert w["mfu_at_bound"] == pytest.approx(2 * 64 * 128 * 256 / (w["bound_seconds"] * 1e12))


def test_xla_cpus_compile_of_an_elementwise_chain_is_one_kernel():
  """x * 2 + 1 then a cast: fused into one kernel that reads x and writes the result."""
  f = jax.jit(lambda x: (x * 2.0 + 1.0).astype(jnp.bfloat16))
  hlo = f.lower(jax.ShapeDtypeStruct((1024, 256), jnp.float32)).compile().as_text()
  t = hlo_traffic.traffic(hlo)
  assert t.kernels == {"matmul": 0, "memory": 1}
  assert t.bytes["memory"] == 1024 * 256 * (4 + 2)


def test_a_snippet_without_an_entry_is_refused():
  with pytest.raises(ValueError, match="ENTRY"):
    hlo_traffic.traffic("%c = f32[2]{0} copy(%a)")


def test_gpu_hlo_lists_the_memory_kernels_that_move_the_most():
  from benchmarks import gpu_hlo  # pylint: disable=import-outside-toplevel
  top = gpu_hlo.top_memory_kernels(hlo_traffic.kernels(_MODULE)[0], 2)
  # The loop body's fusion: 3 runs, then 1 (ahead of the copies that move as much: program
  # order breaks ties).
  assert [(t["kernel"], t["bytes"]) for t in top] == [("step", 3 * 2 * _Y32), ("step", 2 * _Y32)]
