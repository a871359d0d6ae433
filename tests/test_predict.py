"""`bigpretrain.tools.predict`: the per-level semantic view of a trained run."""
import json
import subprocess
import sys

import numpy as np

from bigpretrain.semantic import tree as semantic_tree
from bigpretrain.semantic import view
from input_pipeline import datasets
from tests import helpers


def test_semantic_view_by_hand():
  # dog n02084071 is the root; hunting_dog n02087122 and toy_dog n02085374 are its children.
  tree = semantic_tree.SemanticTree.from_wnids(["n02084071", "n02087122", "n02085374"])
  assert tree.parent.tolist() == [-1, 0, 0]
  logits = np.array([0.0, 2.0, 0.0])  # Level 1 softmax over (1, 2): e^2 / (e^2 + 1) = 0.881.
  levels = view.semantic_view(logits, tree, sigmoid=False, threshold=0.5)
  # Level 0 holds one class (dog, probability 1 whatever the image): not shown.
  assert [v["level"] for v in levels] == [1]
  assert levels[0]["wnid"] == "n02087122" and levels[0]["name"] == "hunting dog"
  np.testing.assert_allclose(levels[0]["prob"], np.exp(2) / (np.exp(2) + 1), rtol=1e-6)
  assert view.semantic_view(logits, tree, False, 0.9) == []
  sig = view.semantic_view(np.array([-1.0, 0.5, 0.0]), tree, sigmoid=True, threshold=0.5)
  assert [v["wnid"] for v in sig] == ["n02087122"]  # sigmoid(-1) < 0.5 at level 0.


def test_predict_cli_on_a_trained_run(tmp_path, demo_run):
  from ml_collections import ConfigDict
  src = datasets.get_dataset(ConfigDict(dict(name="demo", dir=""))).source("validation")
  image = tmp_path / "x.png"
  image.write_bytes(src[0]["image"])
  folder = tmp_path / "folder"
  (folder / "sub").mkdir(parents=True)
  (folder / "sub" / "y.png").write_bytes(src[1]["image"])
  (folder / "notes.txt").write_text("not an image")  # Left out of the folder's images.
  broken = tmp_path / "broken.png"
  broken.write_bytes(b"this is not a png")
  missing = tmp_path / "missing.jpg"
  out = subprocess.run([sys.executable, "-m", "bigpretrain.tools.predict",
                        f"--workdir={demo_run}", "--json", "--threshold=0", str(image),
                        str(broken), str(missing), str(folder)],
                       env=helpers.env(), cwd=helpers.ROOT, capture_output=True, text=True,
                       timeout=300)
  # Each bad file named on one line, the others answered, and a failing exit status.
  assert out.returncode == 1, out.stderr[-2000:]
  errors = [l for l in out.stderr.splitlines() if l.startswith("ERROR: ")]
  assert len(errors) == 2, out.stderr[-2000:]
  assert errors[0].startswith(f"ERROR: {broken}: UnidentifiedImageError")
  assert errors[1] == f"ERROR: {missing}: No such file or directory"
  assert "Traceback" not in out.stderr
  assert len(out.stderr.splitlines()) == 3, out.stderr  # No Orbax/JAX INFO lines.
  rows = [json.loads(l) for l in out.stdout.strip().splitlines()]
  assert [r["image"] for r in rows] == [str(image), str(broken), str(missing),
                                        str(folder / "sub" / "y.png")]
  assert "error" in rows[1] and "error" in rows[2] and "answer" in rows[3]
  row = rows[0]
  assert row["image"] == str(image)
  assert [v["level"] for v in row["levels"]] == list(range(5))  # threshold 0: every level.
  assert all(0 < v["prob"] <= 1 and v["wnid"].startswith("n") for v in row["levels"])
  # The single answer is the hierarchical one (semantic.metrics), a class of the run.
  answer = row["answer"]
  assert answer["wnid"].startswith("n") and 0 < answer["prob"] <= 1
