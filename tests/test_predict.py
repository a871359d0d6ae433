"""`bigpretrain.predict`: the per-level semantic view of a trained run."""
import json
import subprocess
import sys

import numpy as np

from bigpretrain import predict
from bigpretrain import train
from bigpretrain.semantic import tree as semantic_tree
from input_pipeline import datasets
from tests import helpers


def test_semantic_view_by_hand():
  # dog n02084071 is the root; hunting_dog n02087122 and toy_dog n02085374 are its children.
  tree = semantic_tree.SemanticTree.from_wnids(["n02084071", "n02087122", "n02085374"])
  assert tree.parent.tolist() == [-1, 0, 0]
  logits = np.array([0.0, 2.0, 0.0])  # Level 1 softmax over (1, 2): e^2 / (e^2 + 1) = 0.881.
  view = predict.semantic_view(logits, tree, sigmoid=False, threshold=0.5)
  assert [v["level"] for v in view] == [0, 1]
  assert view[0]["wnid"] == "n02084071" and view[0]["prob"] == 1.0
  assert view[1]["wnid"] == "n02087122" and view[1]["name"] == "hunting dog"
  np.testing.assert_allclose(view[1]["prob"], np.exp(2) / (np.exp(2) + 1), rtol=1e-6)
  assert [v["level"] for v in predict.semantic_view(logits, tree, False, 0.9)] == [0]
  sig = predict.semantic_view(np.array([-1.0, 0.5, 0.0]), tree, sigmoid=True, threshold=0.5)
  assert [v["wnid"] for v in sig] == ["n02087122"]  # sigmoid(-1) < 0.5 at level 0.


def test_predict_cli_on_a_trained_run(tmp_path):
  train.train_and_evaluate(helpers.tiny_config(total_steps=2), str(tmp_path / "run"))
  from ml_collections import ConfigDict
  src = datasets.get_dataset(ConfigDict(dict(name="demo", dir=""))).source("validation")
  image = tmp_path / "x.png"
  image.write_bytes(src[0]["image"])
  out = subprocess.run([sys.executable, "-m", "bigpretrain.predict", f"--workdir={tmp_path / 'run'}",
                        "--json", "--threshold=0", str(image)], env=helpers.env(), cwd=helpers.ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  row = json.loads(out.stdout.strip().splitlines()[-1])
  assert row["image"] == str(image)
  assert [v["level"] for v in row["levels"]] == list(range(5))  # threshold 0: every level.
  assert all(0 < v["prob"] <= 1 and v["wnid"].startswith("n") for v in row["levels"])
  # The single answer is the hierarchical one (semantic.metrics), a class of the run.
  answer = row["answer"]
  assert answer["wnid"].startswith("n") and 0 < answer["prob"] <= 1
