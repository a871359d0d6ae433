"""tests/scheduling.py: a worker that crashes costs its one test, and the run ends."""
import re
import subprocess
import sys

from tests import helpers

_FILES = {
    "test_a.py": "def test_1(): pass\ndef test_2(): pass\ndef test_3(): pass\n",
    "test_b.py": "import os\ndef test_crash(): os.abort()\ndef test_after(): pass\n",
    "test_c.py": "def test_one(): pass\n",  # One-test files: a replacement worker's first unit.
    "test_d.py": "def test_one(): pass\n",
    "conftest.py": ("from tests import scheduling\n"
                    "def pytest_xdist_make_scheduler(config, log):\n"
                    "  return scheduling.CrashSafeLoadFileScheduling(config, log)\n"),
    "pytest.ini": "[pytest]\n",
}


def test_a_crashed_worker_costs_its_test_and_the_run_ends(tmp_path):
  """With xdist's own scheduler this run starts test_crash again in every replacement worker
  and then hangs; here it ends, the crash reported once and every other test run."""
  for name, text in _FILES.items():
    (tmp_path / name).write_text(text)
  out = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile",
       "-p", "no:cacheprovider"], cwd=tmp_path, env=helpers.env(), capture_output=True,
      text=True, timeout=120, check=False).stdout
  assert re.search(r"^1 failed, 6 passed in ", out, re.M), out
  assert re.search(r"^FAILED test_b\.py::test_crash - worker 'gw\d' crashed", out, re.M), out
  assert out.count("node down") == 1, out  # Not started again in the replacement worker.
