"""benchmarks/accelerator.py's dry run on the CPU: one JSON line per figure with the documented
keys, then the markdown table of the same figures; every lever's A/B runs, the profile is read
back from its trace, and --out_dir gets the lines and the tables."""
import gzip
import json
import subprocess
import sys
import time
import types

from absl.testing import flagsaver
import jax
import pytest

from benchmarks import accelerator
from benchmarks import profile_ops
from tests import helpers


@pytest.mark.slow  # The demo models' compiles for every figure and arm, in subprocesses.
def test_dry_run_prints_every_figure_and_the_table(tmp_path):
  env = helpers.env(num_devices=1)
  t0 = time.perf_counter()
  r = subprocess.run([sys.executable, "benchmarks/accelerator.py", f"--out_dir={tmp_path}"],
                     env=env, cwd=helpers.ROOT, capture_output=True, text=True,
                     timeout=1500)  # A loaded machine; the dry run itself is short.
  assert r.returncode == 0, r.stderr[-3000:]
  wall_s = time.perf_counter() - t0
  lines = r.stdout.splitlines()
  rows = [json.loads(l) for l in lines if l.startswith("{")]  # Each must parse.
  assert [row["figure"] for row in rows] == list(accelerator.FIGURES)
  for row in rows:
    assert set(accelerator.KEYS) <= set(row), row
    assert row["dry_run"] is True and row["platform"] == "cpu" and row["devices"] == 1
    assert row["value"] is None or isinstance(row["value"], float), row
  # Each figure's own seconds, the xla_flags children's beside: together within the run's.
  by = {row["figure"]: row for row in rows}
  assert by["vit_b16_train"]["figure_s"] > 0 and by["xla_flags"]["children_s"] > 0
  assert sum(row["figure_s"] for row in rows) + by["xla_flags"]["children_s"] < wall_s
  # The trained figures ran the demo models at the dry run's sizes.
  assert by["vit_b16_train"]["model"] == "vit_demo"
  assert by["vit_b16_train"]["batch_size"] == 2 and by["vit_b16_train"]["image_size"] == 32
  assert by["vit_b16_train"]["value"] > 0
  assert by["regnety_16gf_train"]["model"] == "regnety_demo"
  assert by["regnety_16gf_train"]["num_classes"] == 100  # The dry run's hashtags.
  assert 0 < by["esd_memory_ratio"]["value"] < 1  # ESD keeps only the kept rows' activations.
  keep = by["keep_up"]
  assert keep["value"] == keep["pipeline_records_per_sec"] / keep["train_images_per_sec"]
  # The steady-state method: two batches from the one worker first, then whole rounds.
  assert (keep["workers"], keep["warmup_batches"], keep["timed_batches"]) == (1, 2, 3)
  assert keep["records_per_sec_per_worker"] == keep["pipeline_records_per_sec"]
  assert keep["worker_cpu_s_per_record"] >= 0 and keep["consumer_cpu_s_per_record"] >= 0
  # The plan compiles the very step the ViT figure ran: the same FLOPs.
  plan = by["plan_vs_measured"]
  assert plan["planned_flops_per_device"] == plan["measured_flops_per_device"] > 0
  assert plan["measured_step_time_ms"] == by["vit_b16_train"]["step_time_ms"]
  # The table: a header, one row per figure in order, the device named.
  start = lines.index("| figure | value | unit | details |")
  table = lines[start + 2:start + 2 + len(rows)]
  assert [t.split("|")[1].strip() for t in table] == list(accelerator.FIGURES)
  assert lines[-1].startswith("1 x cpu (dry run")
  assert f"jax {jax.__version__}," in lines[-1]
  assert "XLA_FLAGS: --xla_force_host_platform" in lines[-1]
  _check_levers(by)
  # Beside the figures' table, the best measured configuration of each model.
  best = lines[lines.index("Best configuration per model:") + 4:]
  assert {b.split("|")[1].strip() for b in best if b.startswith("| ")} == {
      "vit_demo", "regnety_demo"}
  written = (tmp_path / "accelerator.jsonl").read_text().splitlines()
  assert [json.loads(l) for l in written] == rows
  md = (tmp_path / "accelerator.md").read_text()
  assert "| figure | value | unit | details |" in md
  assert "Top device ops of vit_b16_train (vit_demo) (host trace, per step):" in md
  assert "Top op families of vit_b16_train (vit_demo) (host trace, per step):" in md
  # The best configuration of each model is profiled too (its combined figure's step).
  assert "Top op families of combined_vit_b16 (vit_demo) (host trace, per step):" in md
  assert "Top device ops of combined_regnety_16gf (regnety_demo) (host trace, per step):" in md


def _check_levers(by):
  """Each lever's A/B ran both arms (cuDNN attention as 'xla' off a GPU, and says so)."""
  att = by["attention"]
  assert set(att["arms"]) == {"xla", "cudnn"} and att["value"] > 0
  assert att["ran_as"]["cudnn"]["attention_impl"] == "xla"
  loss = by["attention_loss"]  # The same program twice on the CPU: the same losses.
  assert loss["losses"]["xla"] == loss["losses"]["cudnn"] and len(loss["losses"]["xla"]) == 3
  assert loss["value"] == 0.0 and loss["ran_as"] == {"xla": "xla", "cudnn": "xla"}
  for figure, model in (("head_vit_b16", "vit_demo"), ("head_regnety_16gf", "regnety_demo")):
    head = by[figure]
    assert head["model"] == model and set(head["arms"]) == {"float32", "bfloat16"}
    assert head["arms"]["bfloat16"]["head_dtype"] == "bfloat16"
    assert 0 < head["head_flops_share"] < 1
  assert by["head_regnety_16gf"]["classes"] == 100
  grouped = by["grouped_conv"]
  assert grouped["model"] == "regnety_demo" and set(grouped["arms"]) == {
      "xla", "gemm", "split", "pallas"}
  assert all(grouped["arms"][impl]["grouped_conv_impl"] == impl
             for impl in ("gemm", "split", "pallas"))
  pointwise = by["pointwise_conv"]
  assert pointwise["model"] == "regnety_demo" and set(pointwise["arms"]) == {"xla", "gemm"}
  assert pointwise["arms"]["gemm"]["pointwise_conv_impl"] == "gemm"
  layers = by["grouped_conv_layers"]  # regnety_demo's first two shapes, every impl (CPU).
  shapes = list(accelerator.grouped_conv_shapes("regnety_demo", 2, 32))[:2]
  assert [(tuple(r["input"]), tuple(r["kernel"])) for r in layers["layers"]] == [
      s[:2] for s in shapes]
  assert all(set(r["ms"]) == set(accelerator.layers.GROUPED_CONV_IMPLS) for r in layers["layers"])
  for row in layers["layers"]:  # Each timed form's bfloat16 values against XLA's.
    assert set(row["error"]) == set(row["ms"])
    assert 0 < max(row["error"].values()) <= accelerator.CONV_ERROR_LIMIT, row["error"]
  total = {k: sum(r["layers"] * r["ms"][k] for r in layers["layers"]) for k in layers["total_ms"]}
  assert total == pytest.approx(layers["total_ms"])
  assert layers["value"] == total["xla"] / min(total.values())
  for figure in ("batch_vit_b16", "batch_regnety_16gf"):
    batch = by[figure]  # 2 per device, doubled once; both fit: no remat.
    assert list(batch["arms"]) == ["2", "4"], batch["arms"]
    assert batch["did_not_fit"] == {} and batch["not_tried"] == []
    assert batch["best"] in batch["arms"]
  for figure, trained in (("combined_vit_b16", "vit_b16_train"),
                          ("combined_regnety_16gf", "regnety_16gf_train")):
    combined = by[figure]  # Each lever at its figure's winning arm, all at once.
    assert combined["levers"] == {f: by[f]["best"] for f in accelerator.LEVERS[figure]}
    for lever, keys in accelerator.LEVERS[figure].items():
      won = by[lever]["arms"][by[lever]["best"]]
      assert {k: combined[k] for k in keys} == {k: won[k] for k in keys}, (figure, lever)
    assert combined["speedup_over_recipe"] == combined["value"] / by[trained]["value"]
  flags = by["xla_flags"]  # Two sets on a CPU: XLA's defaults are this process's own flags.
  assert list(flags["arms"]) == ["xla_defaults", "bigpretrain"] and flags["failed"] == {}
  assert flags["this_process"] == ["xla_defaults"]  # Its arm is vit_b16_train's line.
  assert flags["arms"]["xla_defaults"]["images_per_sec"] == by["vit_b16_train"]["value"]
  assert flags["arms"]["bigpretrain"]["images_per_sec"] > 0  # A child process's.
  assert flags["flags"]["xla_defaults"] == ""
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags["flags"]["bigpretrain"]
  prof = by["profile"]
  for key, ops in prof["top_ops"].items():
    ms = [o["ms"] for o in ops]
    assert 0 < len(ops) <= 10 and ms == sorted(ms, reverse=True), key
    assert 0 < sum(o["share"] for o in ops) <= 1 + 1e-9, key
    families = prof["top_families"][key]  # Each holds at least the time of its top op.
    assert families[0]["ms"] >= ops[0]["ms"] and sum(f["ops"] for f in families) >= 1, key
  assert set(prof["traced_ms_per_step"]) == {
      "vit_b16_train", "regnety_16gf_train", "tresnet_m_vs_resnet50:vit_demo",
      "tresnet_m_vs_resnet50:regnety_demo"}


def test_an_arm_that_fails_to_build_is_reported_and_the_others_still_run():
  built, failed = accelerator._build_arms(  # pylint: disable=protected-access
      {"xla": lambda: "runner", "pallas": lambda: 1 / 0, "gemm": lambda: "other"})
  assert built == {"xla": "runner", "gemm": "other"}
  assert failed == {"pallas": "ZeroDivisionError: division by zero"}


def test_grouped_conv_shapes_are_regnety_16gfs_blocks():
  """grouped_conv_layers' shapes: RegNetY-16GF's 3x3 convolutions of group width 112, one
  per block (depths 2, 4, 11, 1; widths 224, 448, 1232, 3024: Radosavovic et al. 2020 /
  torchvision), each stage's first strided, 224-px images halved by the stem."""
  got = accelerator.grouped_conv_shapes("regnety_16gf", 4, 224)
  want = {}
  size = 112
  for depth, width in zip((2, 4, 11, 1), (224, 448, 1232, 3024)):
    want[((4, size, size, width), (3, 3, 112, width), (2, 2), ((1, 1), (1, 1)),
          width // 112)] = 1
    size //= 2
    if depth > 1:
      want[((4, size, size, width), (3, 3, 112, width), (1, 1), ((1, 1), (1, 1)),
            width // 112)] = depth - 1
  assert got == want


def test_on_a_gpu_the_flag_set_this_process_runs_with_is_not_run_again(monkeypatch):
  """On a GPU this process runs with bigpretrain's flags: that set is its own figure; every
  other set is a child process with XLA_FLAGS = the user's flags + the set's."""
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/dump")
  monkeypatch.delenv(accelerator.gpu_flags.OFF_VARIABLE, raising=False)
  for name, _ in accelerator.gpu_flags.ENV:
    monkeypatch.delenv(name, raising=False)
  children = []

  def child(args, env, timeout=None, **kwargs):
    children.append(env["XLA_FLAGS"])
    # The sets differ in XLA flags only: each child has this process's variables.
    assert all(env[name] == value for name, value in accelerator.gpu_flags.ENV)
    assert timeout is None  # No --budget_s.
    line = json.dumps({"figure": "vit_b16_train", "value": 1.0})
    return subprocess.CompletedProcess(args, 0, stdout=line + "\n", stderr="")

  monkeypatch.setattr(accelerator.subprocess, "run", child)
  got = accelerator.run_flag_sets(list(accelerator.FLAG_SETS), steps=None)
  assert list(got) == list(accelerator.FLAG_SETS)
  assert got["bigpretrain"] is accelerator._THIS_PROCESS  # pylint: disable=protected-access
  sets = accelerator.gpu_flags.FLAG_SETS
  assert children == [" ".join(["--xla_dump_to=/tmp/dump", accelerator.gpu_flags.flags_string(
      sets[name])]).strip() for name in accelerator.FLAG_SETS if name != "bigpretrain"]


def test_flag_sets_run_regnety_with_its_kernels_when_asked(monkeypatch):
  """--flag_sets_figure=regnety_16gf_train: each child runs RegNetY-16GF's figure with the
  kernels this process was given, e.g. under cuDNN convolutions in the CUDA graphs."""
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  monkeypatch.delenv(accelerator.gpu_flags.OFF_VARIABLE, raising=False)
  children = []

  def child(args, env, **kwargs):
    children.append((args[2:], env["XLA_FLAGS"]))
    line = json.dumps({"figure": "regnety_16gf_train", "value": 2.0})
    return subprocess.CompletedProcess(args, 0, stdout=line + "\n", stderr="")

  monkeypatch.setattr(accelerator.subprocess, "run", child)
  with flagsaver.flagsaver(flag_sets_figure="regnety_16gf_train", grouped_conv_impl="pallas"):
    got = accelerator.run_flag_sets(["conv_command_buffers"], steps=None)
  assert got == {"conv_command_buffers": {"figure": "regnety_16gf_train", "value": 2.0}}
  [(args, xla_flags)] = children
  assert args == ["--figures=regnety_16gf_train", "--grouped_conv_impl=pallas"]
  assert "--xla_gpu_enable_command_buffer=+CONVOLUTION" in xla_flags.split()


def test_the_budget_bounds_the_flag_set_children(monkeypatch):
  """--budget_s counts the xla_flags children (they run before any figure): a child gets
  what is left of it as its timeout and is stopped there; none starts once it is spent."""
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  monkeypatch.delenv(accelerator.gpu_flags.OFF_VARIABLE, raising=False)
  timeouts = []

  def hung_child(args, env, timeout=None, **kwargs):
    timeouts.append(timeout)
    raise subprocess.TimeoutExpired(args, timeout)

  monkeypatch.setattr(accelerator.subprocess, "run", hung_child)
  names = ["xla_defaults", "triton_gemm"]
  got = accelerator.run_flag_sets(names, steps=None, deadline=time.perf_counter() + 100)
  assert len(timeouts) == 2 and all(0 < t <= 100 for t in timeouts)
  assert all(got[n]["error"].startswith("stopped after") for n in names)
  got = accelerator.run_flag_sets(names, steps=None, deadline=time.perf_counter() - 1)
  assert got == {n: {"error": "not run: --budget_s spent"} for n in names}
  assert len(timeouts) == 2


def test_on_a_gpu_grouped_conv_layers_times_each_pallas_tiling_and_not_wrong_values(
    monkeypatch):
  """On a GPU the figure also times pallas_conv.conv_pallas under each of PALLAS_TILES (here
  interpreted: the kernels lower for CUDA only); a form whose values are off XLA's is
  reported in `failed` and not timed."""
  monkeypatch.setattr(accelerator.jax, "default_backend", lambda: "gpu")
  wrong = lambda *args, **kwargs: 1.1 * accelerator.layers.batch_local_conv(*args, **kwargs)
  monkeypatch.setitem(accelerator.models_base.GROUPED_CONVS, "wrong", wrong)
  suite = accelerator.Suite(dry_run=True, steps=1, rounds=1)
  suite.grouped_conv_layers()
  line = suite.lines[-1]
  tilings = {"pallas:" + "/".join(map(str, t)) for t in accelerator.PALLAS_TILES}
  assert set(line["total_ms"]) == set(accelerator.layers.GROUPED_CONV_IMPLS) | tilings
  assert list(line["failed"]) == ["wrong"] and "values off XLA's" in line["failed"]["wrong"]
  # Its loss and gradients are 1.1^2 times XLA's (in bfloat16); not built for later shapes.
  assert line["layers"][0]["error"]["wrong"] == pytest.approx(0.21, rel=0.05)
  for row in line["layers"]:
    assert set(row["ms"]) == set(line["total_ms"])
    assert max(row["error"][k] for k in row["ms"]) <= accelerator.CONV_ERROR_LIMIT


def test_past_the_budget_xla_flags_reports_its_children_and_runs_nothing(suite):
  """The children ran before any figure and are paid for: their figure reports them once the
  budget is spent, and the arm this process would have run is not run."""
  child = {"figure": "vit_b16_train", "value": 100.0, "model": "vit_demo", "step_time_ms": 20.0,
           "mfu": None, "batch_per_device": 2, **accelerator.settings(suite.vit_config())}
  suite.flag_lines = {"xla_defaults": accelerator._THIS_PROCESS,  # pylint: disable=protected-access
                      "bigpretrain": child}
  suite.deadline = time.perf_counter() - 1
  suite.xla_flags()
  line = suite.lines[-1]
  assert [l["figure"] for l in suite.lines] == ["xla_flags"]  # vit_b16_train not run.
  assert line["failed"] == {"xla_defaults": "not run: --budget_s spent"}
  assert line["arms"]["bigpretrain"]["images_per_sec"] == 100.0 and line["value"] is None


def test_xla_flags_reports_its_children_when_this_processs_arm_fails(suite, monkeypatch):
  """A child's measurement is paid for: it is reported when this process's arm fails, and a
  figure that failed before in this process is not compiled again."""
  child = {"figure": "vit_b16_train", "value": 100.0, "model": "vit_demo", "step_time_ms": 20.0,
           "mfu": None, "batch_per_device": 2, **accelerator.settings(suite.vit_config())}
  suite.flag_lines = {"xla_defaults": accelerator._THIS_PROCESS,  # pylint: disable=protected-access
                      "bigpretrain": child}
  calls = []

  def failing():
    calls.append(1)
    raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

  monkeypatch.setattr(suite, "vit_b16", failing)
  suite.xla_flags()
  line = suite.lines[-1]
  assert line["failed"] == {"xla_defaults": "RuntimeError: RESOURCE_EXHAUSTED: out of memory"}
  assert line["arms"]["bigpretrain"]["images_per_sec"] == 100.0
  assert suite.failed == {"vit_b16_train": line["failed"]["xla_defaults"]}
  suite.xla_flags()  # As after main() saw the figure fail: not run again.
  assert len(calls) == 1 and suite.lines[-1]["failed"] == line["failed"]


class _Runner:
  """common.Runner's stand-in: out of memory above `fits` images per device (twice that
  under a remat policy), else a step of 1 ms per image."""
  fits = 2

  def __init__(self, config, dataset=None):
    del dataset
    per_device = config.batch_size // jax.device_count()
    if per_device > self.fits * (2 if config.model.get("remat") else 1):
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate.")
    self.config, self.flops = config, 1.0
    self.exp = types.SimpleNamespace(
        model_def=types.SimpleNamespace(kwargs={"attention_impl": "xla"}))

  def run(self, steps):
    del steps
    return 1e-3 * self.config.batch_size


@pytest.fixture
def suite(monkeypatch):
  monkeypatch.setattr(accelerator.common, "Runner", _Runner)
  monkeypatch.setattr(accelerator, "standin_dataset", lambda *args: None)
  out = accelerator.Suite(dry_run=True, steps=1, rounds=1)  # 2 images per device first.
  monkeypatch.setattr(out, "trace_ops", lambda *args: None)
  return out


def test_batch_without_the_papers_size_tries_remat_there_and_gives_no_speed_up(
    suite, monkeypatch):
  monkeypatch.setattr(_Runner, "fits", 1)
  suite.batch("batch_vit_b16", "vit_b16_train", suite.vit_config())
  line = suite.lines[-1]
  assert list(line["did_not_fit"]) == ["2"]  # No larger size tried.
  assert list(line["arms"]) == ["2+dots_saveable"] and line["best"] == "2+dots_saveable"
  assert line["value"] is None


@pytest.mark.parametrize("fits,arms", [(2, ["2", "4+dots_saveable"]), (4, ["2", "4"])])
def test_batch_tries_remat_only_at_a_size_that_does_not_fit(suite, monkeypatch, fits, arms):
  monkeypatch.setattr(_Runner, "fits", fits)
  suite.batch("batch_vit_b16", "vit_b16_train", suite.vit_config())
  line = suite.lines[-1]
  assert list(line["arms"]) == arms and list(line["did_not_fit"]) == ["4"][:4 // fits - 1]
  assert line["value"] == 1.0  # 1 ms per image at each size.


def test_past_the_budget_batch_tries_no_further_size(suite, monkeypatch):
  """Every size the doublings would have tried is listed as not tried, none as not fitting."""
  monkeypatch.setattr(_Runner, "fits", 2)
  monkeypatch.setitem(accelerator.BATCH_DOUBLINGS, "vit_demo", 3)
  suite.deadline = time.perf_counter() - 1  # Spent: the papers' size is still measured.
  suite.batch("batch_vit_b16", "vit_b16_train", suite.vit_config())
  line = suite.lines[-1]
  assert list(line["arms"]) == ["2"] and line["not_tried"] == ["4", "8", "16"]
  assert line["did_not_fit"] == {} and line["value"] == 1.0


def test_combined_halves_a_batch_its_levers_do_not_fit_down_to_the_papers(
    suite, monkeypatch):
  suite.lines = [{"figure": "vit_b16_train", "value": 1000.0},
                 {"figure": "batch_vit_b16", "best": "8",
                  "arms": {"8": {"batch_per_device": 8, "remat": "none"}}}]
  monkeypatch.setattr(_Runner, "fits", 4)
  suite.combined("combined_vit_b16", "vit_b16_train", suite.vit_config())
  line = suite.lines[-1]
  assert line["batch_per_device"] == 4 and list(line["did_not_fit"]) == ["8"]
  assert line["value"] == 1000.0  # 1 ms per image.
  # A lever figure with no arm that ran (best None) picks nothing; the others still apply.
  suite.lines[1:] = [{"figure": "batch_vit_b16", "best": None, "arms": {}},
                     {"figure": "head_vit_b16", "best": "bfloat16",
                      "arms": {"bfloat16": {"head_dtype": "bfloat16"}}}]
  suite.combined("combined_vit_b16", "vit_b16_train", suite.vit_config())
  line = suite.lines[-1]
  assert line["levers"] == {"head_vit_b16": "bfloat16"} and line["head_dtype"] == "bfloat16"
  assert line["batch_per_device"] == 2 and line["did_not_fit"] == {}
  monkeypatch.setattr(_Runner, "fits", 1)  # Not even the papers' 2: the figure fails.
  with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
    suite.combined("combined_vit_b16", "vit_b16_train", suite.vit_config())


def test_profile_reads_a_gpu_trace_kernels_by_op(tmp_path):
  """A GPU trace: kernels on the device's stream lines, summed per HLO op (a cuDNN call's two
  kernels as one op) and per op family (two cuDNN convolutions as one); the device's summary
  line and the host's events left out. Kernels a command buffer (CUDA graph) launches count
  under their own names, in the families of their kind."""
  run = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00"
  run.mkdir(parents=True)
  meta = lambda pid, tid, kind, name: {"ph": "M", "pid": pid, "tid": tid, "name": kind,
                                       "args": {"name": name}}
  span = lambda pid, tid, name, dur, op=None: {
      "ph": "X", "pid": pid, "tid": tid, "name": name, "ts": 0, "dur": dur,
      "args": {"hlo_op": op, "hlo_module": "jit_train_step"} if op else {}}
  events = [meta(1, None, "process_name", "/device:GPU:0"),
            meta(1, 7, "thread_name", "Stream #7(Compute)"),
            meta(1, 9, "thread_name", "XLA Modules"),
            meta(2, None, "process_name", "/host:CPU"),
            span(1, 7, "sm90_xmma_gemm_bf16", 300.0, "cublas-gemm.1"),
            span(1, 7, "cudnn_conv_kernel_a", 100.0, "cudnn-conv.2"),
            span(1, 7, "cudnn_conv_kernel_b", 150.0, "cudnn-conv.2"),
            span(1, 7, "cudnn_conv_kernel_c", 100.0, "cudnn-conv.5"),
            span(1, 7, "loop_add_fusion", 50.0, "loop_add_fusion"),
            span(1, 7, "nvjet_sm90_tst_128x128_64x6", 40.0, "command_buffer_3"),
            span(1, 7, "sm90_xmma_gemm_bf16bf16_tn", 30.0, "command_buffer_3"),
            span(1, 7, "input_add_fusion_12", 20.0, "command_buffer_3"),
            span(1, 7, "input_add_fusion_7", 10.0, "command_buffer_9"),
            span(1, 9, "jit_train_step", 600.0),
            span(2, 3, "ExecuteHelper", 900.0, "cublas-gemm.1")]
  (run / "host.trace.json.gz").write_bytes(gzip.compress(json.dumps(
      {"traceEvents": events}).encode()))
  top = profile_ops.top_ops(tmp_path, n=2)
  assert top["source"] == "device" and top["total_ms"] == 0.8
  assert top["ops"] == [
      {"op": "cublas-gemm.1", "ms": 0.3, "share": 300 / 800, "count": 1,
       "kernel": "sm90_xmma_gemm_bf16"},
      {"op": "cudnn-conv.2", "ms": 0.25, "share": 250 / 800, "count": 2,
       "kernel": "cudnn_conv_kernel_a"}]
  # By family, the two cuDNN convolutions (0.35 ms) come before the one GEMM.
  assert top["families"] == [
      {"family": "cudnn-conv", "ms": 0.35, "share": 350 / 800, "ops": 2},
      {"family": "cublas-gemm", "ms": 0.3, "share": 300 / 800, "ops": 1}]
  every = {f["family"]: (round(f["ms"], 6), f["ops"])
           for f in profile_ops.top_ops(tmp_path, n=10)["families"]}
  assert every == {"cudnn-conv": (0.35, 2), "cublas-gemm": (0.3, 1),
                   "loop_add_fusion": (0.05, 1), "cublas gemm kernels": (0.07, 2),
                   "input_add_fusion": (0.03, 2)}
