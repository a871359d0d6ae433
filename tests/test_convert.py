"""bigpretrain.tools.convert: timm / torchvision weights give the same logits in bigpretrain, and
export gives back the source library's exact state dict.

Models are randomly initialised by timm / torchvision (no downloads) at small input sizes;
every constant tensor (BatchNorm / LayerNorm affine and running statistics, biases, heads,
class tokens, LayerScale) is redrawn so that a swapped or dropped tensor changes the logits.
"""
import json
import math
import os
import sys

from absl import flags
from flax import nnx
import jax
import numpy as np
import pytest

from bigpretrain import checkpoint
from bigpretrain.evaluators import evaluate
from bigpretrain import config_lib
from bigpretrain import models
from bigpretrain import predict
from bigpretrain import sharding
from bigpretrain.models import convert
from bigpretrain.models import pretrained
from bigpretrain.tools import convert as convert_tool
from input_pipeline import augment_spec

pytestmark = pytest.mark.interop  # torch / timm references (the interop extra)

_REASON = "needs the interop extra (torch, torchvision, timm, safetensors): " + \
    convert.INTEROP_HINT


def _need(name):
  return pytest.importorskip(name, reason=_REASON)


def _randomize(model, seed=0):
  """Redraws constant float tensors: zeros ~ N(0, 0.1), other constants ~ U(0.5, 1.5)."""
  torch = _need("torch")
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for t in model.state_dict().values():
      if not t.is_floating_point() or t.numel() < 2 or t.min() != t.max():
        continue
      if float(t.flatten()[0]) == 0.0:
        t.copy_(torch.randn(t.shape, generator=g) * 0.1)
      else:
        t.copy_(torch.rand(t.shape, generator=g) + 0.5)
  return model.eval()


def _timm(name, **kw):
  return _randomize(_need("timm").create_model(name, pretrained=False, **kw))


def _torchvision(name, **kw):
  _need("torch")
  return _randomize(getattr(_need("torchvision").models, name)(**kw))


def _torchvision_vit_ti(image_size):
  """torchvision's VisionTransformer class (the layout of vit_b_16 and SWAG's ViTs) at
  DeiT-Ti size."""
  _need("torch")
  from torchvision.models import vision_transformer  # pylint: disable=import-outside-toplevel
  return _randomize(vision_transformer.VisionTransformer(
      image_size, 16, num_layers=12, num_heads=3, hidden_dim=192, mlp_dim=768,
      num_classes=10))


def _state_dict(model):
  return {k: v.numpy() for k, v in model.state_dict().items()}


def _save(model, path):
  """The model's state dict as a .safetensors (no torch needed to read) or .pth file."""
  if str(path).endswith(".safetensors"):
    _need("safetensors.numpy").save_file(_state_dict(model), str(path))
  else:
    _need("torch").save(model.state_dict(), str(path))
  return str(path)


def _images(size, n=2, seed=0):
  return np.random.default_rng(seed).normal(size=(n, size, size, 3)).astype(np.float32)


def _torch_logits(model, images, features=False):
  torch = _need("torch")
  x = torch.from_numpy(images.transpose(0, 3, 1, 2).copy())
  with torch.no_grad():
    if features:  # timm's pre-logits features
      return model.forward_head(model.forward_features(x), pre_logits=True).numpy()
    return model(x).numpy()


def _logits(model, images):
  """Eval-mode logits of a bigpretrain model, jitted (one compile beats op-by-op dispatch)."""
  return nnx.jit(lambda m, x: m(x))(model, images)


def _preset(timm_model) -> str:
  """timm's pretrained_cfg mean / std as a config.data.normalize preset."""
  mean, std = timm_model.pretrained_cfg["mean"], timm_model.pretrained_cfg["std"]
  presets = {((0.0,) * 3, (1.0,) * 3): "0_1", ((0.5,) * 3, (0.5,) * 3): "minus1_1",
             ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)): "imagenet"}
  return presets[(tuple(mean), tuple(std))]


def _assert_close(ours, theirs):
  """Equal within 1e-4 relative to the logits' scale (at least 1e-4 absolute)."""
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  assert ours.shape == theirs.shape
  tol = 1e-4 * max(1.0, float(np.abs(theirs).max()))
  assert float(np.abs(ours - theirs).max()) <= tol, (np.abs(ours - theirs).max(), tol)


# (source, builder, image size, file suffix): one per converted architecture.
CASES = [
    ("timm:vit_tiny_patch16_224",
     lambda: _timm("vit_tiny_patch16_224", img_size=32, num_classes=10), 32, ".safetensors"),
    ("timm:vit_base_patch16_224_miil_in21k",
     lambda: _timm("vit_base_patch16_224_miil", img_size=32, num_classes=11221), 32,
     ".safetensors"),
    ("timm:deit3_small_patch16_224",
     lambda: _timm("deit3_small_patch16_224", img_size=32, num_classes=10), 32, ".pth"),
    ("torchvision:vit_ti_16", lambda: _torchvision_vit_ti(32), 32, ".safetensors"),
    ("timm:resnet18", lambda: _timm("resnet18", num_classes=10), 64, ".safetensors"),
    ("torchvision:resnet18", lambda: _torchvision("resnet18", num_classes=10), 64, ".pth"),
    ("torchvision:resnext50_32x4d",
     lambda: _torchvision("resnext50_32x4d", num_classes=10), 64, ".safetensors"),
    ("torchvision:regnet_y_400mf",
     lambda: _torchvision("regnet_y_400mf", num_classes=10), 64, ".safetensors"),
    ("timm:tresnet_m", lambda: _timm("tresnet_m", num_classes=10), 64, ".safetensors"),
    ("timm:mobilenetv3_large_100",
     lambda: _timm("mobilenetv3_large_100", num_classes=10), 64, ".safetensors"),
    ("timm:mixer_s16_224", lambda: _timm("mixer_s16_224", img_size=32, num_classes=10), 32,
     ".safetensors"),
]


@pytest.mark.parametrize("spec,build,size,suffix", CASES, ids=[c[0] for c in CASES])
def test_logits_equal_and_export_is_identity(spec, build, size, suffix, tmp_path):
  torch_model = build()
  weights = _save(torch_model, tmp_path / f"weights{suffix}")
  meta = convert.import_weights(spec, weights, str(tmp_path / "ckpt"))
  images = _images(size)
  theirs = _torch_logits(torch_model, images)
  loaded = pretrained.load(str(tmp_path / "ckpt"))  # What models.load_pretrained returns.
  _assert_close(_logits(loaded.module(), images), theirs)
  assert meta["num_classes"] == theirs.shape[1]
  if spec.startswith("timm:"):  # The input normalisation the weights expect.
    assert meta["data"]["normalize"] == _preset(torch_model)

  # Export gives back exactly the tensors the library saved, and it loads them strictly.
  # (export_weights without its second checkpoint read: the CLI test runs it whole.)
  out = str(tmp_path / f"exported{suffix}")
  exported = convert.from_bigpretrain(jax.device_get(loaded.variables), loaded.model_def,
                                      meta["source"]["from"])
  convert.write_state_dict(exported, out)
  original = _state_dict(torch_model)
  assert sorted(exported) == sorted(original)
  for key, value in original.items():
    np.testing.assert_array_equal(exported[key], value, err_msg=key)
  torch_model.load_state_dict({k: _need("torch").from_numpy(v)
                               for k, v in convert.read_state_dict(out).items()}, strict=True)
  np.testing.assert_array_equal(_torch_logits(torch_model, images), theirs)


def _regnet_y(depth, w_0, w_a, w_m, group_width):
  """torchvision's RegNet class for regnet_y_* parameters (regnet_y_128gf carries SWAG's
  weights); its BlockParams are computed on the CPU (they cannot be on the meta device)."""
  from torchvision.models import regnet  # pylint: disable=import-outside-toplevel
  with _need("torch").device("cpu"):
    params = regnet.BlockParams.from_init_params(depth=depth, w_0=w_0, w_a=w_a, w_m=w_m,
                                                 group_width=group_width, se_ratio=0.25)
  return regnet.RegNet(params)


# The released full-size layouts: (source, builder of the library's model, image size).
FULL_SIZE = [
    ("timm:vit_base_patch16_224_miil_in21k",
     lambda: _need("timm").create_model("vit_base_patch16_224_miil", num_classes=11221), 224),
    ("timm:deit3_base_patch16_224", lambda: _need("timm").create_model("deit3_base_patch16_224"),
     224),
    ("torchvision:vit_h_14", lambda: _need("torchvision").models.vit_h_14(image_size=518), 518),
    ("timm:resnet50", lambda: _need("timm").create_model("resnet50"), None),
    ("torchvision:resnext101_32x16d",
     lambda: _need("torchvision").models.resnet.ResNet(
         _need("torchvision").models.resnet.Bottleneck, [3, 4, 23, 3], groups=32,
         width_per_group=16), None),
    ("torchvision:regnet_y_128gf", lambda: _regnet_y(27, 456, 160.83, 2.52, 264), None),
    ("timm:tresnet_l", lambda: _need("timm").create_model("tresnet_l"), None),
    ("timm:mixer_b16_224", lambda: _need("timm").create_model("mixer_b16_224"), 224),
]


@pytest.mark.parametrize("spec,build,size", FULL_SIZE, ids=[c[0] for c in FULL_SIZE])
def test_full_size_layouts_match_exactly(spec, build, size):
  """Every tensor name and shape of the released architecture maps, none left over (built on
  torch's meta device: shapes without memory)."""
  torch = _need("torch")
  with torch.device("meta"):
    model = build()
  sd = {k: np.broadcast_to(np.float32(0), tuple(v.shape)) for k, v in model.state_dict().items()}
  model_def, variables, cfg = convert.to_bigpretrain(sd, spec)
  assert cfg.get("image_size") == size
  assert model_def.kwargs["num_classes"] == sd[convert.torch_name(
      convert.get_arch(spec), "head/bias")].shape[0]
  n_ours = sum(x.size for x in jax.tree.leaves(variables))
  n_theirs = sum(v.size for k, v in sd.items() if not k.endswith("num_batches_tracked"))
  assert n_ours == n_theirs


def test_batchnorm_statistics_are_carried_into_extra(tmp_path):
  torch_model = _torchvision("resnet18", num_classes=10)
  convert.import_weights("torchvision:resnet18",
                         _save(torch_model, tmp_path / "w.safetensors"), str(tmp_path / "c"))
  loaded = pretrained.load(str(tmp_path / "c"))
  extra = jax.device_get(loaded.variables["extra"])
  np.testing.assert_array_equal(extra["stem_bn"]["mean"], torch_model.bn1.running_mean.numpy())
  np.testing.assert_array_equal(extra["blocks"][6]["downsample_bn"]["var"],
                                torch_model.layer4[0].downsample[1].running_var.numpy())


def test_position_embedding_resized_as_torchvision_does(tmp_path):
  torch = _need("torch")
  torch_model = _torchvision_vit_ti(32)
  meta = convert.import_weights("torchvision:vit_ti_16",
                                _save(torch_model, tmp_path / "w.safetensors"),
                                str(tmp_path / "c"), image_size=64)
  assert meta["data"]["image_size"] == 64 and meta["model"]["image_size"] == 64
  model = models.load_pretrained(str(tmp_path / "c"))
  pos = torch_model.encoder.pos_embedding.detach()  # [1, 1 + 2 * 2, 192]
  grid = pos[:, 1:].reshape(1, 2, 2, 192).permute(0, 3, 1, 2)
  want = torch.nn.functional.interpolate(grid, size=(4, 4), mode="bicubic", align_corners=True)
  want = torch.cat([pos[:, :1], want.permute(0, 2, 3, 1).reshape(1, 16, 192)], 1).numpy()
  np.testing.assert_allclose(np.asarray(model.pos_embed[...]), want, atol=1e-5)
  assert _logits(model, _images(64)).shape == (2, 10)
  with pytest.raises(ValueError, match="token-mixing MLPs fix the image size"):
    convert.to_bigpretrain(_state_dict(_timm("mixer_s16_224", img_size=32)),
                           "timm:mixer_s16_224", image_size=64)


@pytest.mark.parametrize("method, torch_options", [
    ("bicubic_align_corners", dict(align_corners=True)),  # ClassyVision / torchvision.
    ("bicubic", dict(align_corners=False)),  # DeiT's fine-tuning.
    ("bicubic_antialias", dict(align_corners=False, antialias=True)),  # timm's default.
])
@pytest.mark.parametrize("old, new", [((4, 4), (7, 7)), ((14, 14), (24, 24)), ((7, 7), (3, 5))])
def test_position_embedding_resize_equals_torch_interpolate(method, torch_options, old, new):
  torch = _need("torch")
  from bigpretrain.models import vit  # pylint: disable=import-outside-toplevel
  pos = np.random.RandomState(0).normal(size=(1, 1 + old[0] * old[1], 8)).astype(np.float32)
  got = np.asarray(vit.resize_pos_embed(pos, old, new, num_prefix=1, method=method))
  grid = torch.from_numpy(pos[:, 1:]).reshape(1, *old, 8).permute(0, 3, 1, 2)
  want = torch.nn.functional.interpolate(grid, size=new, mode="bicubic", **torch_options)
  want = want.permute(0, 2, 3, 1).reshape(1, -1, 8).numpy()
  np.testing.assert_array_equal(got[:, :1], pos[:, :1])
  np.testing.assert_allclose(got[:, 1:], want, atol=2e-5)


def test_new_num_classes_keeps_backbone_and_reinitialises_head(tmp_path, capsys):
  torch_model = _timm("vit_tiny_patch16_224", img_size=32, num_classes=10)
  meta = convert.import_weights("timm:vit_tiny_patch16_224",
                                _save(torch_model, tmp_path / "w.safetensors"),
                                str(tmp_path / "c"), num_classes=3)
  assert meta["num_classes"] == 3
  model = models.load_pretrained(str(tmp_path / "c"))
  images = _images(32)
  _assert_close(nnx.jit(lambda m, x: m.features(x))(model, images),
                _torch_logits(torch_model, images, features=True))
  np.testing.assert_array_equal(np.asarray(model.head.kernel[...]), np.zeros((192, 3)))
  # config.model_init into a 3-class model keeps everything; into 5 classes, a fresh head.
  model_def = models.ModelDef.from_config({"name": "vit_ti16", "image_size": 32}, 5)
  params, extra = model_def.create(jax.random.key(1))
  _, fresh, _, _ = checkpoint.init_from(str(tmp_path / "c"), {"params": params, "extra": extra})
  assert fresh == ["params/head/bias", "params/head/kernel"]
  # Weights saved without a classifier (timm num_classes=0): a fresh head of --num_classes.
  headless = _timm("vit_tiny_patch16_224", img_size=32, num_classes=0)
  sd = {k: v.detach().numpy() for k, v in headless.state_dict().items()}
  with pytest.raises(ValueError, match="no classifier tensor 'head.bias'.*give --num_classes"):
    convert.to_bigpretrain(sd, "timm:vit_tiny_patch16_224")
  model_def, variables, _ = convert.to_bigpretrain(sd, "timm:vit_tiny_patch16_224",
                                                   num_classes=4)
  model = model_def.merge(variables["params"], variables["extra"])
  _assert_close(nnx.jit(lambda m, x: m.features(x))(model, images),
                _torch_logits(headless, images, features=True))
  assert np.asarray(model.head.kernel[...]).shape == (192, 4)
  # timm's num_classes=0 ("no head") and other sizes no model has: refused before writing.
  for key, value, what in (("num_classes", 0, "classes"), ("num_classes", -2, "classes"),
                           ("image_size", 0, "side in pixels")):
    with pytest.raises(ValueError, match=rf"--{key}={value} must be an int >= 1 \(.*{what}"):
      convert.import_weights("timm:vit_tiny_patch16_224", str(tmp_path / "w.safetensors"),
                             str(tmp_path / "bad"), **{key: value})
  assert not (tmp_path / "bad").exists()
  # Exported for a library that normalises its inputs otherwise: the weights as they are,
  # and a warning naming both presets.
  capsys.readouterr()
  convert.export_weights(str(tmp_path / "c"), str(tmp_path / "tv.safetensors"),
                         "torchvision:vit_ti_16")
  assert "normalised as 'minus1_1'; torchvision:vit_ti_16's models are fed 'imagenet'" in (
      capsys.readouterr().out)


def test_converted_checkpoint_serves_predict(tmp_path):
  """bigpretrain.tools.predict reads the meta (normalisation, eval resize, objective)."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  torch_model = _timm("resnet18", num_classes=10)
  convert.import_weights("timm:resnet18", _save(torch_model, tmp_path / "w.safetensors"),
                         str(tmp_path / "c"), image_size=64)
  image = tmp_path / "x.png"
  Image.fromarray(np.random.default_rng(0).integers(0, 255, (80, 96, 3), np.uint8)).save(image)
  (result,) = predict.predict(str(tmp_path / "c"), [str(image)], 0.5)
  assert len(result["top5"]) == 5
  meta = json.loads(json.dumps(checkpoint.read_meta(str(tmp_path / "c"))))
  assert meta["source"]["from"] == "timm:resnet18" and meta["data"]["normalize"] == "imagenet"
  assert meta["data"]["eval_resize"] == "center_crop(0.95, bicubic)"
  # It was trained on no dataset of ours: evaluating it needs one named.
  with pytest.raises(ValueError, match="converted from timm:resnet18.*give --datasets"):
    evaluate.evaluate(str(tmp_path / "c"))
  # A meta naming no known resize: one error naming the checkpoint, before any image.
  model_def, variables, _ = convert.to_bigpretrain(_state_dict(torch_model), "timm:resnet18")
  convert.write_checkpoint(str(tmp_path / "bad"), model_def, variables, "timm:resnet18",
                           "w.safetensors", eval_resize="center_crop(2)")
  with pytest.raises(ValueError, match=r"bad's meta: data\.eval_resize='center_crop\(2\)'"):
    predict.predict(str(tmp_path / "bad"), [str(image)], 0.5)
  # Teachers (semantic KD, infer) load it sharded over a mesh by the logical rules.
  mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 2})
  loaded = pretrained.load(str(tmp_path / "c"), mesh=mesh,
                           rules=config_lib.base_config().sharding_rules)
  kernel = loaded.variables["params"]["blocks"][7]["conv2"]["kernel"]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, None, None, "tensor")
  np.testing.assert_array_equal(np.asarray(kernel), torch_model.layer4[1].conv2.weight.detach()
                                .numpy().transpose(2, 3, 1, 0))


def test_mismatching_state_dict_names_first_tensor():
  resnet18 = _state_dict(_timm("resnet18"))
  with pytest.raises(ValueError, match=r"timm:resnet50: first mismatching tensor "
                     r"'layer1\.0\.bn3\.bias' is missing"):
    convert.to_bigpretrain(resnet18, "timm:resnet50")
  vit_tiny = _state_dict(_timm("vit_tiny_patch16_224", img_size=32))
  with pytest.raises(ValueError, match=r"'blocks\.0\.attn\.proj\.bias' has shape \(192,\), "
                     r"expected \(384,\)"):
    convert.to_bigpretrain(vit_tiny, "timm:vit_small_patch16_224")
  # MIIL's ImageNet-21K-P ViT has no qkv bias (timm's vit_base_patch16_224_miil).
  no_qkv_bias = _state_dict(_timm("vit_tiny_patch16_224", img_size=32, qkv_bias=False))
  with pytest.raises(ValueError, match=r"first mismatching tensor 'blocks\.0\.attn\.qkv\.bias' "
                     "is missing"):
    convert.to_bigpretrain(no_qkv_bias, "timm:vit_tiny_patch16_224")
  with pytest.raises(ValueError, match=r"tensors the model lacks, first 'extra\.weight'"):
    convert.to_bigpretrain({**resnet18, "extra.weight": np.zeros(3)}, "timm:resnet18")
  with pytest.raises(ValueError, match="no classifier tensor 'fc.bias'"):
    convert.to_bigpretrain(vit_tiny, "torchvision:resnet18")
  with pytest.raises(ValueError, match="unknown source 'timm:resnet51'"):
    convert.to_bigpretrain(resnet18, "timm:resnet51")


def test_nan_weights_and_negative_variances_are_named_in_a_warning(capsys):
  """A state dict written from our own resnet18 (no torch needed), then damaged."""
  model_def = convert._model_def({"name": "resnet18"}, 10)  # pylint: disable=protected-access
  ones = {"params": model_def.abstract_pure_params(), "extra": model_def.abstract_pure_extra()}
  ones = jax.tree.map(lambda x: np.ones(x.shape, x.dtype), ones)
  sd = convert.from_bigpretrain(ones, model_def, "timm:resnet18")
  assert convert.warn_bad_values(sd) == []
  sd["layer1.0.conv1.weight"][0, 0, 0, 0] = np.nan
  sd["fc.bias"][3] = np.inf
  sd["layer2.1.bn2.running_var"][5] = -0.5
  convert.to_bigpretrain(sd, "timm:resnet18")
  out = capsys.readouterr().out.strip().splitlines()
  assert out == [
      "WARNING: 2 tensors hold NaN or infinite values: layer1.0.conv1.weight, fc.bias. The "
      "weights are converted as they are; check their source.",
      "WARNING: 1 BatchNorm running variances are negative: layer2.1.bn2.running_var. The "
      "weights are converted as they are; check their source."]


def _timm_cfg(name):
  """timm's pretrained cfg of the default tag of the model a spec names."""
  timm = _need("timm")
  cfg = timm.models.get_pretrained_cfg(name.replace("_miil_in21k", "_miil.in21k"))
  if cfg is None and name == "mixer_b16_224_miil_in21k":  # timm's name for it.
    cfg = timm.models.get_pretrained_cfg("mixer_b16_224.miil_in21k")
  assert cfg is not None, f"timm has no model {name}"
  return cfg


def test_imported_eval_resize_is_the_source_librarys_eval_transform():
  """timm: the default tag's crop_pct (shorter side floor(S / crop_pct)) and interpolation.
  torchvision: for each weight file it publishes, found by its name, Resize(resize) then
  CenterCrop(crop) with its interpolation; a file of another name gets one of them."""
  torchvision = _need("torchvision")
  checked = 0
  for spec, arch in convert.ARCHS.items():
    library, name = spec.split(":")
    if library == "timm":
      cfg = _timm_cfg(name)
      op = augment_spec.eval_resize_op(arch.eval_resize)
      size = cfg.input_size[-1]
      assert cfg.crop_mode in (None, "center"), spec
      assert op.fraction == cfg.crop_pct and op.ratio is None, (spec, arch.eval_resize)
      assert op.scale_size(size) == math.floor(size / cfg.crop_pct), spec
      assert op.resample == augment_spec.INTERPOLATIONS[cfg.interpolation], spec
      checked += 1
      continue
    try:
      weights = torchvision.models.get_model_weights(name)
    except ValueError:  # vit_ti_16 / vit_s_16 (test-size models) and the hubs' ResNeXts.
      assert name not in convert._TORCHVISION_FILES  # pylint: disable=protected-access
      continue
    published = set()
    for w in weights:
      transform, file_name = w.transforms(), os.path.basename(w.url)
      op = augment_spec.eval_resize_op(convert.source_eval_resize(spec, file_name))
      assert op.scale_size(transform.crop_size[0]) == transform.resize_size[0], (spec, w)
      assert op.resample == augment_spec.INTERPOLATIONS[transform.interpolation.value], w
      published.add(convert.source_eval_resize(spec, file_name))
      checked += 1
    assert set(convert._TORCHVISION_FILES[name]) == {  # pylint: disable=protected-access
        os.path.basename(w.url).split(".")[0] for w in weights}, spec
    assert arch.eval_resize in published, spec
  assert checked >= 70, checked


def test_a_torchvision_file_of_another_name_gets_the_assumed_transform_and_a_warning(capsys):
  resize = convert.source_eval_resize
  assert resize("torchvision:resnet50", "/w/resnet50-11ad3fa6.pth") == (
      "center_crop(224/232, bilinear)")  # IMAGENET1K_V2
  assert resize("torchvision:resnet50", "resnet50-0676ba61.safetensors") == (
      "center_crop(224/256, bilinear)")  # IMAGENET1K_V1, saved under another suffix
  assert capsys.readouterr().out == ""
  assert resize("torchvision:resnet50", "mine.pth") == "center_crop(224/256, bilinear)"
  assert ("WARNING: mine.pth is not a file torchvision publishes for torchvision:resnet50"
          in capsys.readouterr().out)
  # One published transform (resnet18, vit_h_14's two SWAG files), or none: nothing to say.
  assert resize("torchvision:resnet18", "mine.pth") == "center_crop(224/256, bilinear)"
  assert resize("torchvision:vit_h_14", "mine.pth") == "center_crop(1.0, bicubic)"
  assert resize("torchvision:vit_ti_16", "mine.pth") == "center_crop(1.0, bicubic)"
  assert resize("timm:vit_base_patch16_224", "model.safetensors") == (
      "center_crop(0.9, bicubic)")
  assert capsys.readouterr().out == ""


def test_export_refuses_another_architecture(tmp_path):
  convert.import_weights("timm:resnet18", _save(_timm("resnet18", num_classes=10),
                                                tmp_path / "w.safetensors"), str(tmp_path / "c"))
  with pytest.raises(ValueError, match="model is 'resnet18'; timm:resnet50 is 'resnet50'"):
    convert.export_weights(str(tmp_path / "c"), str(tmp_path / "o.safetensors"),
                           "timm:resnet50")
  with pytest.raises(ValueError, match="expected a .safetensors"):
    convert.export_weights(str(tmp_path / "c"), str(tmp_path / "o.npz"))


def test_unusable_out_is_refused_before_the_weights_are_read(tmp_path):
  """The --out check comes before the weights are read (the file below is no weight file),
  naming the flag; a weight file that does not exist is refused before --out is made."""
  (tmp_path / "a_file").write_text("")
  (tmp_path / "w.safetensors").write_bytes(b"not read")
  with pytest.raises(ValueError, match="--out=.*a_file cannot be written as a folder"):
    convert.import_weights("timm:resnet18", str(tmp_path / "w.safetensors"),
                           str(tmp_path / "a_file"))
  with pytest.raises(FileNotFoundError, match="weight file .*missing.safetensors does not exist"):
    convert.import_weights("timm:resnet18", str(tmp_path / "missing.safetensors"),
                           str(tmp_path / "new"))
  assert not (tmp_path / "new").exists()
  (tmp_path / "d.safetensors").mkdir()
  with pytest.raises(ValueError, match="--out=.*is a folder; give a file name"):
    convert.export_weights(str(tmp_path / "no_ckpt"), str(tmp_path / "d.safetensors"))
  with pytest.raises(ValueError, match="the folder .*no_such_dir does not exist"):
    convert.export_weights(str(tmp_path / "no_ckpt"),
                           str(tmp_path / "no_such_dir" / "o.safetensors"))


def test_corrupt_files_are_clear_errors(tmp_path):
  _need("torch")
  _need("safetensors")
  for name in ("w.safetensors", "w.pth"):
    path = tmp_path / name
    path.write_bytes(b"\x00\x01not weights at all" * 10)
    with pytest.raises(ValueError, match=f"{name} is not a readable"):
      convert.read_state_dict(str(path))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    convert.read_state_dict(str(tmp_path / "missing.pth"))
  with pytest.raises(FileNotFoundError, match=rf"weight file {tmp_path} is a folder, not a file"):
    convert.read_state_dict(str(tmp_path))
  with pytest.raises(ValueError, match="unknown weight file type '.h5'"):
    (tmp_path / "w.h5").write_bytes(b"x")
    convert.read_state_dict(str(tmp_path / "w.h5"))


class _Payload:
  """Unpickling this runs os.mkdir(marker): what a malicious weight file would do."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (os.mkdir, (self.marker,))


def test_pickle_carrying_code_is_refused_not_run(tmp_path):
  torch = _need("torch")
  marker = str(tmp_path / "code_ran")
  path = str(tmp_path / "evil.pth")
  torch.save({"weight": torch.zeros(2), "payload": _Payload(marker)}, path)
  with pytest.raises(ValueError, match=r"refused to load .*evil.pth.*weights_only=True.*"
                     r"GLOBAL \w+\.mkdir"):
    convert.read_state_dict(path)
  assert not os.path.exists(marker)
  torch.load(path, weights_only=False)  # The payload is real: a full unpickle runs it.
  assert os.path.isdir(marker)


def test_missing_extra_names_the_pip_command(tmp_path, monkeypatch):
  (tmp_path / "w.pth").write_bytes(b"x")
  (tmp_path / "w.safetensors").write_bytes(b"x")
  monkeypatch.setitem(sys.modules, "torch", None)
  monkeypatch.setitem(sys.modules, "safetensors", None)
  monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
  for name in ("w.pth", "w.safetensors"):
    with pytest.raises(ImportError, match=r"pip install -e '\.\[interop\]'"):
      convert.read_state_dict(str(tmp_path / name))


def _main(capsys, *args) -> tuple[int, str]:
  """Runs `python -m bigpretrain.tools.convert ARGS` in this process, on its own flag values:
  (exit code, stdout + stderr)."""
  flag_values = flags.FlagValues()
  convert_tool.define_flags(flag_values)
  flag_values(["convert", *args])
  try:
    convert_tool.run(flag_values)
    code = 0
  except SystemExit as e:
    code = e.code
  out = capsys.readouterr()
  return code, out.out + out.err


def test_command_line_import_with_class_names_and_export(tmp_path, capsys):
  torch_model = _timm("resnet18", num_classes=3)
  weights = _save(torch_model, tmp_path / "w.pth")
  names = tmp_path / "names.txt"
  names.write_text("n01440764\nn01443537\nn01484850\n")
  code, out = _main(capsys, "--from=timm:resnet18", f"--weights={weights}",
                    f"--out={tmp_path / 'c'}", f"--class_names={names}", "--image_size=64")
  assert code == 0, out
  meta = checkpoint.read_meta(str(tmp_path / "c"))
  assert meta["class_names"] == ["n01440764", "n01443537", "n01484850"]
  assert meta["data"]["image_size"] == 64
  assert meta["data"]["eval_resize"] == "center_crop(0.95, bicubic)"  # timm's resnet18.a1
  assert "eval_resize=center_crop(0.95, bicubic)" in out
  code, out = _main(capsys, "--from=timm:resnet18", f"--weights={weights}",
                    f"--out={tmp_path / 'tv'}", "--eval_resize=center_crop(0.875)")
  assert code == 0, out
  assert checkpoint.read_meta(str(tmp_path / "tv"))["data"]["eval_resize"] == (
      "center_crop(0.875)")
  code, out = _main(capsys, "--from=timm:resnet18", f"--weights={weights}",
                    f"--out={tmp_path / 'bad'}", "--eval_resize=center_crop(1.1)")
  assert code == 1 and "ERROR: --eval_resize='center_crop(1.1)': the crop fraction" in out
  assert not (tmp_path / "bad").exists()
  code, out = _main(capsys, "--export", f"--weights={tmp_path / 'c'}",
                    f"--out={tmp_path / 'out.pth'}")
  assert code == 0, out
  exported = convert.read_state_dict(str(tmp_path / "out.pth"))
  np.testing.assert_array_equal(exported["fc.weight"], torch_model.fc.weight.detach().numpy())
  code, out = _main(capsys, "--from=timm:resnet50", f"--weights={weights}",
                    f"--out={tmp_path / 'd'}")
  assert code == 1 and "ERROR: the state dict does not match timm:resnet50" in out
  with pytest.raises(ValueError, match="lists 3 classes; the head has 5"):
    convert.import_weights("timm:resnet18", weights, str(tmp_path / "e"), num_classes=5,
                           class_names=str(names))
