"""Weight import and export: timm / torchvision state dicts <-> bigpretrain checkpoints.

Import writes a bigpretrain checkpoint (items 'params' and 'meta', step 0) that
config.model_init, teachers, infer, zero_shot, predict and models.load_pretrained read.
Export writes the state dict the source library's model loads with strict=True (BatchNorm
`num_batches_tracked` written as 0); --to defaults to the layout the checkpoint came from.

Names map by per-architecture rules on dotted paths (our 'blocks/3/attn/qkv/kernel' is
'blocks.3.attn.qkv.weight' before the rules); leaves: conv kernel [kh, kw, I, O] <- torch
weight [O, I, kh, kw], linear kernel [I, O] <- weight [O, I], LayerNorm / BatchNorm scale <-
weight, BatchNorm mean / var <- running_mean / running_var (carried into 'extra').

Evaluation: the meta's data.eval_resize reproduces the source library's published eval
transform of the weights (timm: its default tag's crop_pct and interpolation, e.g.
center_crop(0.9, bicubic); torchvision: its weights' Resize / CenterCrop sizes, e.g.
center_crop(224/232, bilinear), by the file name torchvision publishes them under);
--eval_resize records another.

Image size: ViT and Mixer take it from the weights (position embedding / token-MLP size);
--image_size resizes a ViT's position-embedding grid as the source library does
(models.vit.ORIGIN_RESIZE: torchvision bicubic with align_corners, timm its antialiased
bicubic). A Mixer's token-mixing MLP is tied to its token count, so it cannot change size.
--num_classes other than the weights' keeps the backbone and gives a freshly initialised head
(model_init's rule).

Security: weight files come from the internet. `.safetensors` is read with the safetensors
numpy API (no torch, no code); `.pth` / `.pt` / `.torch` / `.bin` pickles only through
torch.load(weights_only=True), which refuses pickles that would construct arbitrary objects.
"""
import dataclasses
import math
import os
import pickle
import re
from collections.abc import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from bigpretrain import checkpoint
from bigpretrain.runtime import console
from bigpretrain.runtime import out_paths
from input_pipeline import augment_spec

INTEROP_HINT = "pip install -e '.[interop]'"
PICKLE_SUFFIXES = (".pth", ".pt", ".torch", ".bin")
_LEAVES = {"kernel": "weight", "scale": "weight", "mean": "running_mean",
           "var": "running_var"}

Rule = tuple[str, str | Callable]


def _stage_blocks(stages: tuple[int, ...], fmt: str) -> Rule:
  """Rule mapping our flat 'blocks.k.' to `fmt` of (stage s, index i in the stage)."""
  def sub(m):
    k = int(m.group(1))
    for s, n in enumerate(stages):
      if k < n:
        return fmt.format(s=s, s1=s + 1, i=k)
      k -= n
    raise ValueError(f"block {m.group(1)} is beyond the stages {stages}")
  return (r"^blocks\.(\d+)\.", sub)


@dataclasses.dataclass(frozen=True)
class Arch:
  """One source layout: the bigpretrain model it maps to and how names translate."""
  model: str  # registered bigpretrain model name
  rules: tuple[Rule, ...]  # regex substitutions, in order, on our dotted names
  normalize: str  # the source's input normalisation (config.data.normalize preset)
  options: dict = dataclasses.field(default_factory=dict)  # model options of the variant
  # The library's eval transform of the weights (data.eval_resize); for torchvision, of the
  # weights assumed when the file name is not one it publishes (see _TORCHVISION_FILES).
  eval_resize: str = "center_crop"
  sized_by: str | None = None  # 'pos_embed' (ViT) or 'tokens' (Mixer): size from weights


_TIMM_VIT = ((r"^patch_embed\.", "patch_embed.proj."),)
_TORCHVISION_VIT = (
    (r"^cls_token$", "class_token"), (r"^pos_embed$", "encoder.pos_embedding"),
    (r"^patch_embed\.", "conv_proj."),
    (r"^blocks\.(\d+)\.", r"encoder.layers.encoder_layer_\1."),
    (r"\.norm1\.", ".ln_1."), (r"\.norm2\.", ".ln_2."),
    (r"\.attn\.qkv\.(weight|bias)$", r".self_attention.in_proj_\1"),
    (r"\.attn\.proj\.", ".self_attention.out_proj."),
    (r"\.mlp\.fc1\.", ".mlp.0."), (r"\.mlp\.fc2\.", ".mlp.3."),
    (r"^norm\.", "encoder.ln."), (r"^head\.", "heads.head."),
    (r"^pre_logits\.", "heads.pre_logits."))


def _resnet_rules(stages):
  return ((r"^stem_conv\.", "conv1."), (r"^stem_bn\.", "bn1."),
          _stage_blocks(stages, "layer{s1}.{i}."),
          (r"\.downsample_conv\.", ".downsample.0."), (r"\.downsample_bn\.", ".downsample.1."),
          (r"^head\.", "fc."))


def _regnet_rules(stages):
  return ((r"^stem_conv\.", "stem.0."), (r"^stem_bn\.", "stem.1."),
          _stage_blocks(stages, "trunk_output.block{s1}.block{s1}-{i}."),
          (r"\.conv_([abc])\.", r".f.\1.0."), (r"\.bn_([abc])\.", r".f.\1.1."),
          (r"\.se\.", ".f.se."), (r"\.proj_conv\.", ".proj.0."), (r"\.proj_bn\.", ".proj.1."),
          (r"^head\.", "fc."))


# timm's TResNet: everything under 'body.' but the head ('head.fc.'); a shortcut is
# Sequential(AvgPool, ConvNormAct), so its parameters sit at index 1 (in TResNet-M/L every
# shortcut is on a strided block; see models/tresnet.py).
_TRESNET = ((r"^head\.", "head.fc."), (r"^(?!head\.fc\.)", "body."),
            (r"\.downsample\.", ".downsample.1."))
# timm's mobilenetv3_large_100: stages of 1, 2, 3, 4, 2, 3 blocks, then the 1x1 conv to 960
# as stage 6 (ConvBnAct: conv, bn1).
_MOBILENET = ((r"^bn_stem\.", "bn1."), _stage_blocks((1, 2, 3, 4, 2, 3), "blocks.{s}.{i}."),
              (r"^conv_last\.", "blocks.6.0.conv."), (r"^bn_last\.", "blocks.6.0.bn1."),
              (r"^head\.", "classifier."))
_MIXER = ((r"^patch_embed\.", "stem.proj."), (r"\.token_mixing\.", ".mlp_tokens."),
          (r"\.channel_mixing\.", ".mlp_channels."))
_RESNET_STAGES = {"18": (2, 2, 2, 2), "50": (3, 4, 6, 3), "101": (3, 4, 23, 3),
                  "152": (3, 8, 36, 3)}
_DEIT3 = {"layerscale_init": 1e-6, "pos_embed_cls": False}  # DeiT-III: LS, no cls pos-emb.

# The source libraries' eval transforms as data.eval_resize, recorded in the meta so that
# imported weights are evaluated as their library evaluates them. timm: crop_pct and
# interpolation of the default pretrained tag (timm.models.get_pretrained_cfg(name)).
_TIMM_090 = "center_crop(0.9, bicubic)"  # AugReg ViTs and DeiT-III at 224 px
_TIMM_095 = "center_crop(0.95, bicubic)"  # ResNets (ResNet strikes back a1 / a1h)
_TIMM_0875 = "center_crop(0.875, bicubic)"  # MobileNetV3, Google's Mixers
_MIIL = "center_crop(0.875, bilinear)"  # MIIL's ViT, Mixer and TResNets
_FULL = "center_crop(1.0, bicubic)"  # timm's 384-px ViTs; SWAG (end to end and linear heads)
# torchvision: weights.transforms() is Resize(resize) then CenterCrop(crop), written crop/resize.
_TV_V1 = "center_crop(224/256, bilinear)"  # IMAGENET1K_V1
_TV_V2 = "center_crop(224/232, bilinear)"  # IMAGENET1K_V2
# torchvision publishes several weights per builder, evaluated differently; their files are
# told apart by name: builder -> {file name without suffix: eval resize}.
_TORCHVISION_FILES = {
    "vit_b_16": {"vit_b_16-c867db91": _TV_V1, "vit_b_16_swag-9ac1b537": _FULL,
                 "vit_b_16_lc_swag-4e70ced5": _FULL},
    "vit_b_32": {"vit_b_32-d86f8d99": _TV_V1},
    "vit_l_16": {"vit_l_16-852ce7e3": "center_crop(224/242, bilinear)",
                 "vit_l_16_swag-4f3808c9": _FULL, "vit_l_16_lc_swag-4d563306": _FULL},
    "vit_l_32": {"vit_l_32-c7638314": _TV_V1},
    "vit_h_14": {"vit_h_14_swag-80465313": _FULL, "vit_h_14_lc_swag-c1eb923e": _FULL},
    "resnet18": {"resnet18-f37072fd": _TV_V1},
    "resnet50": {"resnet50-0676ba61": _TV_V1, "resnet50-11ad3fa6": _TV_V2},
    "resnet101": {"resnet101-63fe2227": _TV_V1, "resnet101-cd907fc2": _TV_V2},
    "resnet152": {"resnet152-394f9c45": _TV_V1, "resnet152-f82ba261": _TV_V2},
    "resnext50_32x4d": {"resnext50_32x4d-7cdf4587": _TV_V1,
                        "resnext50_32x4d-1a0047aa": _TV_V2},
    "resnext101_32x8d": {"resnext101_32x8d-8ba56ff5": _TV_V1,
                         "resnext101_32x8d-110c445d": _TV_V2},
    "regnet_y_400mf": {"regnet_y_400mf-c65dace8": _TV_V1, "regnet_y_400mf-e6988f5f": _TV_V2},
    "regnet_y_8gf": {"regnet_y_8gf-d0d0e4a8": _TV_V1, "regnet_y_8gf-dc2b1b54": _TV_V2},
    "regnet_y_16gf": {"regnet_y_16gf-9e6ed7dd": _TV_V1, "regnet_y_16gf-3e4a00f9": _TV_V2,
                      "regnet_y_16gf_swag-43afe44d": _FULL,
                      "regnet_y_16gf_lc_swag-f3ec0043": _FULL},
    "regnet_y_32gf": {"regnet_y_32gf-4dee3f7a": _TV_V1, "regnet_y_32gf-8db6d4b5": _TV_V2,
                      "regnet_y_32gf_swag-04fdfa75": _FULL,
                      "regnet_y_32gf_lc_swag-e1583746": _FULL},
    "regnet_y_128gf": {"regnet_y_128gf_swag-c8ce3e52": _FULL,
                       "regnet_y_128gf_lc_swag-cbe8ce12": _FULL},
}


def _archs() -> dict[str, Arch]:
  out = {}
  # timm ViTs (AugReg weights: mean = std = 0.5). timm evaluates its 384-px weights on the
  # full centre crop (crop_pct 1.0), the others at 0.9, both bicubic.
  full = {224: _TIMM_090, 384: _FULL}
  sizes = {"tiny": "ti", "small": "s", "medium": "m", "base": "b", "large": "l", "huge": "h"}
  for name in ("tiny_patch16", "small_patch16", "small_patch32", "base_patch16",
               "base_patch32", "large_patch16", "large_patch32"):
    size, patch = name.split("_patch")
    for res in (224, 384):
      out[f"timm:vit_{name}_{res}"] = Arch(f"vit_{sizes[size]}{patch}", _TIMM_VIT, "minus1_1",
                                           sized_by="pos_embed", eval_resize=full[res])
  # ImageNet-21K-P ViT-B/16 (Ridnik et al. 2021; timm 'vit_base_patch16_224_miil.in21k'):
  # no qkv bias, inputs in [0, 1] (timm's cfg: mean 0, std 1), 11,221 classes, bilinear.
  miil = Arch("vit_b16", _TIMM_VIT, "0_1", {"qkv_bias": False}, sized_by="pos_embed",
              eval_resize=_MIIL)
  out["timm:vit_base_patch16_224_miil_in21k"] = out["timm:vit_base_patch16_224_miil"] = miil
  for size in ("small", "medium", "base", "large"):
    for res in (224, 384) if size != "medium" else (224,):  # timm has no medium at 384.
      out[f"timm:deit3_{size}_patch16_{res}"] = Arch(f"vit_{sizes[size]}16", _TIMM_VIT,
                                                     "imagenet", _DEIT3, sized_by="pos_embed",
                                                     eval_resize=full[res])
  out["timm:deit3_huge_patch14_224"] = Arch("vit_h14", _TIMM_VIT, "imagenet", _DEIT3,
                                            sized_by="pos_embed", eval_resize=_TIMM_090)
  # torchvision's VisionTransformer (SWAG's ViTs are vit_b_16 / vit_l_16 / vit_h_14 at
  # 384 / 512 / 518 px, evaluated on a full centre crop of the shorter side, bicubic: assumed
  # for a file torchvision does not publish; vit_b_32 and vit_l_32 have only IMAGENET1K_V1
  # weights, resize 256 and crop 224). vit_ti_16 and vit_s_16 are that class at DeiT sizes
  # (not torchvision builders; small test models).
  for size, patch in (("ti", 16), ("s", 16), ("b", 16), ("b", 32), ("l", 16), ("l", 32),
                      ("h", 14)):
    out[f"torchvision:vit_{size}_{patch}"] = Arch(
        f"vit_{size}{patch}", _TORCHVISION_VIT, "imagenet", sized_by="pos_embed",
        eval_resize=_TV_V1 if patch == 32 else _FULL)
  # ResNets: timm's default tags (a1 / a1h) at crop_pct 0.95, bicubic; torchvision's
  # IMAGENET1K_V1 (resize 256) assumed for a file torchvision does not publish.
  for depth, stages in _RESNET_STAGES.items():
    out[f"timm:resnet{depth}"] = Arch(f"resnet{depth}", _resnet_rules(stages), "imagenet",
                                      eval_resize=_TIMM_095)
    out[f"torchvision:resnet{depth}"] = Arch(f"resnet{depth}", _resnet_rules(stages),
                                             "imagenet", eval_resize=_TV_V1)
  # ResNeXts: torchvision's, and the semi-supervised / weakly supervised hubs' (Yalniz et al.
  # 2019, Mahajan et al. 2018), which use torchvision's ResNet class (IMAGENET1K_V1's
  # transform assumed for files torchvision does not publish).
  for name, depth in (("resnext50_32x4d", "50"), ("resnext101_32x4d", "101"),
                      ("resnext101_32x8d", "101"), ("resnext101_32x16d", "101"),
                      ("resnext101_32x48d", "101")):
    out[f"torchvision:{name}"] = Arch(name, _resnet_rules(_RESNET_STAGES[depth]), "imagenet",
                                      eval_resize=_TV_V1)
  # torchvision RegNetY (regnet_y_128gf carries only SWAG's RegNetY-128GF weights, evaluated
  # on the full centre crop: 384 px end to end, 224 for the linear head, --image_size; the
  # others IMAGENET1K_V1's transform for a file torchvision does not publish).
  from bigpretrain.models import regnet  # pylint: disable=import-outside-toplevel
  for size in ("400mf", "8gf", "16gf", "32gf", "128gf"):
    name = f"regnety_{size}"
    stages = tuple(n for _, n, _ in regnet.regnet_stages(*regnet._REGNETY[name]))  # pylint: disable=protected-access
    out[f"torchvision:regnet_y_{size}"] = Arch(
        name, _regnet_rules(stages), "imagenet",
        eval_resize=_FULL if size == "128gf" else _TV_V1)
  # TResNet (timm cfg: mean 0, std 1).
  out["timm:tresnet_m"] = Arch("tresnet_m", _TRESNET, "0_1", eval_resize=_MIIL)
  out["timm:tresnet_l"] = Arch("tresnet_l", _TRESNET, "0_1", eval_resize=_MIIL)
  out["timm:mobilenetv3_large_100"] = Arch("mobilenetv3_large_100", _MOBILENET, "imagenet",
                                           eval_resize=_TIMM_0875)
  for size in ("s", "b", "l"):
    out[f"timm:mixer_{size}16_224"] = Arch(f"mixer_{size}16", _MIXER, "minus1_1",
                                           sized_by="tokens", eval_resize=_TIMM_0875)
  out["timm:mixer_b16_224_miil_in21k"] = Arch("mixer_b16", _MIXER, "0_1", sized_by="tokens",
                                              eval_resize=_MIIL)
  return out


ARCHS = _archs()


def get_arch(spec: str) -> Arch:
  if spec not in ARCHS:
    fmt = spec.split(":")[0]
    known = sorted(a for a in ARCHS if a.startswith(fmt + ":")) or sorted(ARCHS)
    raise ValueError(f"unknown source {spec!r}; expected FORMAT:ARCH, one of: "
                     f"{', '.join(known)}")
  return ARCHS[spec]


def torch_name(arch: Arch, path: str) -> str:
  """Our 'a/b/kernel' -> the source library's state-dict key."""
  *mods, leaf = path.split("/")
  name = ".".join(mods + [_LEAVES.get(leaf, leaf)])
  for pattern, repl in arch.rules:
    name = re.sub(pattern, repl, name)
  return name


def to_torch_layout(path: str, x: np.ndarray) -> np.ndarray:
  if path.endswith("kernel") and x.ndim == 4:
    return x.transpose(3, 2, 0, 1)
  if path.endswith("kernel") and x.ndim == 2:
    return x.T
  return x


def from_torch_layout(path: str, x: np.ndarray) -> np.ndarray:
  if path.endswith("kernel") and x.ndim == 4:
    return x.transpose(2, 3, 1, 0)
  if path.endswith("kernel") and x.ndim == 2:
    return x.T
  return x


def _import_torch():
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f"reading or writing PyTorch pickles needs torch: {INTEROP_HINT} "
                      "(or use a .safetensors file, read without torch)") from e
  return torch


def _import_safetensors():
  try:
    from safetensors import numpy as st_numpy  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f".safetensors files need the safetensors package: {INTEROP_HINT}") from e
  return st_numpy


def _unwrap(obj, path: str) -> dict:
  """The state dict inside a checkpoint dict ('state_dict' / 'model' wrappers, DataParallel's
  'module.' prefix)."""
  for key in ("state_dict", "model", "model_state"):
    if isinstance(obj, dict) and isinstance(obj.get(key), dict):
      obj = obj[key]
  if not isinstance(obj, dict) or not obj:
    raise ValueError(f"{path} holds a {type(obj).__name__}, not a state dict of tensors")
  if all(k.startswith("module.") for k in obj):
    obj = {k[len("module."):]: v for k, v in obj.items()}
  return obj


def _check_weight_file(path: str) -> None:
  if not os.path.isfile(path):
    what = "is a folder, not a file" if os.path.isdir(path) else "does not exist"
    raise FileNotFoundError(f"weight file {path} {what}")


def read_state_dict(path: str) -> dict[str, np.ndarray]:
  """A weight file's tensors as numpy arrays (floating point as float32)."""
  _check_weight_file(path)
  suffix = os.path.splitext(path)[1].lower()
  if suffix == ".safetensors":
    st_numpy = _import_safetensors()
    try:
      tensors = st_numpy.load_file(path)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"{path} is not a readable .safetensors file "
                       f"({type(e).__name__}: {e})") from e
  elif suffix in PICKLE_SUFFIXES:
    torch = _import_torch()
    try:
      obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
      # torch names a refused callable or class as 'GLOBAL module.name'.
      refused = [line.strip() for line in str(e).splitlines() if "GLOBAL" in line]
      if not refused:
        lines = [line.strip() for line in str(e).splitlines()
                 if line.strip() and not line.startswith("Check the documentation")]
        raise ValueError(f"{path} is not a readable PyTorch weight file (the unpickler "
                         f"failed: {lines[-1] if lines else type(e).__name__})") from e
      raise ValueError(
          f"refused to load {path}: the pickle would call or build objects other than "
          f"tensors (possibly code), which torch.load(weights_only=True) does not run: "
          f"{refused[0]} Get the weights as .safetensors or from a trusted source.") from e
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"{path} is not a readable PyTorch weight file "
                       f"({type(e).__name__}: {e})") from e
    tensors = {}
    for k, v in _unwrap(obj, path).items():
      if not isinstance(v, torch.Tensor):
        raise ValueError(f"{path}: entry {k!r} is a {type(v).__name__}, not a tensor")
      tensors[k] = (v.float() if v.is_floating_point() else v).numpy()
  else:
    raise ValueError(f"{path}: unknown weight file type {suffix!r}; expected .safetensors or "
                     f"one of {PICKLE_SUFFIXES}")
  return {k: v.astype(np.float32) if np.issubdtype(v.dtype, np.floating) else v
          for k, v in _unwrap(tensors, path).items()}


def _flat(tree: dict) -> dict:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p, simple=True, separator="/"): v for p, v in leaves}


def _unflat(flat: dict) -> dict:
  out = {"params": {}, "extra": {}}
  for path, v in flat.items():
    *parents, leaf = path.split("/")
    node = out
    for p in parents:
      node = node.setdefault(int(p) if p.isdigit() else p, {})
    node[int(leaf) if leaf.isdigit() else leaf] = v
  return out


def _source_size(arch: Arch, spec: str, sd: dict) -> int | None:
  """The image size the weights were trained at (ViT / Mixer); None for CNNs."""
  if arch.sized_by is None:
    return None
  if arch.sized_by == "tokens":
    key, axis, prefix = torch_name(arch, "blocks/0/token_mixing/fc1/kernel"), 1, 0
  else:
    key, axis = torch_name(arch, "pos_embed"), 1
    prefix = 0 if arch.options.get("pos_embed_cls", True) is False else 1
  patch_key = torch_name(arch, "patch_embed/kernel")
  for k in (key, patch_key):
    if k not in sd:
      raise ValueError(f"the state dict is not {spec}: it has no tensor {k!r}")
  tokens = sd[key].shape[axis] - prefix
  grid = math.isqrt(tokens)
  if grid * grid != tokens:
    raise ValueError(f"{key!r} has {tokens} patch tokens, not a square grid")
  return grid * sd[patch_key].shape[-1]


def _model_def(cfg: dict, num_classes: int):
  from bigpretrain import models  # pylint: disable=import-outside-toplevel
  return models.ModelDef.from_config(cfg, num_classes)


def expected_tensors(arch: Arch, model_def) -> dict[str, tuple[str, tuple[int, ...]]]:
  """Source key -> (our path, source shape) for every array of `model_def`."""
  out = {}  # Parameters first: the order errors name the first mismatch in.
  params = _flat({"params": model_def.abstract_pure_params()})
  for path, x in {**params, **_flat({"extra": model_def.abstract_pure_extra()})}.items():
    ours = path.split("/", 1)[1]
    shape = to_torch_layout(ours, np.empty(x.shape, np.uint8)).shape
    out[torch_name(arch, ours)] = (path, tuple(shape))
  return out


def warn_bad_values(sd: dict[str, np.ndarray]) -> list[str]:
  """Warns, naming the tensors, about NaN or infinite values and BatchNorm running variances
  below zero (weights of a diverged run or a damaged file, which the conversion would carry
  on silently); returns the warnings."""

  def named(keys):
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")

  nonfinite = [k for k, v in sd.items() if np.issubdtype(np.asarray(v).dtype, np.inexact)
               and not np.isfinite(v).all()]
  negative = [k for k, v in sd.items() if k.endswith("running_var") and (np.asarray(v) < 0).any()]
  out = []
  if nonfinite:
    out.append(f"{len(nonfinite)} tensors hold NaN or infinite values: {named(nonfinite)}.")
  if negative:
    out.append(f"{len(negative)} BatchNorm running variances are negative: {named(negative)}.")
  for text in out:
    console.warn(f"{text} The weights are converted as they are; check their source.")
  return out


def to_bigpretrain(state_dict: dict, spec: str, *, num_classes: int | None = None,
                   image_size: int | None = None, seed: int = 0):
  """Maps a source state dict onto the bigpretrain model of `spec` ('timm:resnet50').

  Returns (model_def, {'params', 'extra'} numpy trees, model config). Raises ValueError
  naming the first tensor that is missing or has another shape, and any tensor left over.
  Weights without a classifier (timm's num_classes=0 files, e.g. vit_large_patch32_224's
  orig_in21k) get a fresh head of `num_classes`, which they then need.
  """
  arch = get_arch(spec)
  sd = dict(state_dict)
  head_key = torch_name(arch, "head/bias")
  headless = head_key not in sd
  if headless and num_classes is None:
    raise ValueError(f"the state dict of {spec} has no classifier tensor {head_key!r} (its "
                     f"first tensors: {list(sd)[:4]}): give --num_classes for a new head")
  src_classes = int(num_classes) if headless else int(sd[head_key].shape[0])
  src_size = _source_size(arch, spec, sd)
  cfg = {"name": arch.model, **arch.options}
  if arch.model.startswith("vit") and torch_name(arch, "pre_logits/bias") in sd:
    cfg["pre_logits"] = True  # torchvision's representation layer (heads.pre_logits)
  if src_size is not None:
    cfg["image_size"] = src_size
  model_def = _model_def(cfg, src_classes)
  expected = expected_tensors(arch, model_def)
  flat = {}
  for key, (path, shape) in expected.items():
    if headless and path.startswith("params/head/"):
      continue  # A fresh head, below.
    if key not in sd:
      raise ValueError(f"the state dict does not match {spec}: first mismatching tensor "
                       f"{key!r} is missing (expected shape {shape})")
    if tuple(sd[key].shape) != shape:
      raise ValueError(f"the state dict does not match {spec}: first mismatching tensor "
                       f"{key!r} has shape {tuple(sd[key].shape)}, expected {shape}")
    flat[path] = from_torch_layout(path, sd[key])
  extra = [k for k in sd if k not in expected and not k.endswith("num_batches_tracked")]
  if extra:
    raise ValueError(f"the state dict does not match {spec}: it has tensors the model lacks, "
                     f"first {extra[0]!r} ({len(extra)} in all)")
  warn_bad_values({k: sd[k] for k in expected if k in sd})

  if image_size is not None and image_size != cfg.get("image_size", image_size):
    if arch.sized_by != "pos_embed":
      raise ValueError(f"{spec}: the token-mixing MLPs fix the image size to "
                       f"{cfg['image_size']}; --image_size={image_size} is not possible")
    flat["params/pos_embed"] = _resize_pos_embed(flat["params/pos_embed"], cfg, image_size,
                                                 spec)
  num_classes = src_classes if num_classes is None else int(num_classes)
  if image_size is not None and image_size != cfg.get("image_size"):
    cfg["image_size"] = image_size
    model_def = _model_def(cfg, num_classes)
  elif num_classes != src_classes:
    model_def = _model_def(cfg, num_classes)
  if num_classes != src_classes or headless:  # A fresh head, as config.model_init does.
    fresh = _flat(dict(zip(("params", "extra"), model_def.create(jax.random.key(seed)))))
    for path, value in fresh.items():
      if path.startswith("params/head/"):
        flat[path] = np.asarray(value)
  return model_def, _unflat(flat), cfg


def _resize_pos_embed(pos: np.ndarray, cfg: dict, image_size: int, spec: str) -> np.ndarray:
  from bigpretrain.models import vit  # pylint: disable=import-outside-toplevel
  patch = int(re.search(r"(\d+)$", cfg["name"]).group(1))
  if image_size % patch:
    raise ValueError(f"--image_size={image_size} is not divisible by the patch size {patch}")
  old, new = cfg["image_size"] // patch, image_size // patch
  prefix = 0 if cfg.get("pos_embed_cls", True) is False else 1
  method = vit.ORIGIN_RESIZE[spec.split(":", 1)[0]]
  return np.asarray(vit.resize_pos_embed(pos, (old, old), (new, new), num_prefix=prefix,
                                         method=method))


def read_class_names(path: str, num_classes: int) -> list[str]:
  """One class name per line (e.g. wnids), in the order of the head's outputs."""
  with open(path, encoding="utf-8") as f:
    names = [line.strip() for line in f if line.strip()]
  if len(names) != num_classes:
    raise ValueError(f"--class_names={path} lists {len(names)} classes; the head has "
                     f"{num_classes}")
  return names


def source_eval_resize(spec: str, weights: str) -> str:
  """The data.eval_resize that reproduces the eval transform `spec`'s library publishes for
  the weight file `weights`. torchvision's builders have several weights (IMAGENET1K_V1 / V2,
  SWAG's), told apart by file name (resnet50-11ad3fa6.pth: V2, Resize(232)); another name
  gets the architecture's assumed transform, with a warning where the published ones differ."""
  arch = get_arch(spec)
  library, name = spec.split(":", 1)
  published = _TORCHVISION_FILES.get(name, {}) if library == "torchvision" else {}
  file_name = os.path.basename(weights)
  stem = file_name.split(".", 1)[0]  # resnet50-11ad3fa6.pth, or saved as .safetensors
  if stem in published:
    return published[stem]
  if len(set(published.values())) > 1:
    console.warn(f"{file_name} is not a file torchvision publishes for {spec}, whose weights "
                 f"it evaluates with different transforms: the checkpoint records "
                 f"eval_resize={arch.eval_resize!r}; give --eval_resize if these weights "
                 f"were evaluated otherwise (torchvision's: "
                 f"{', '.join(sorted(set(published.values())))}).")
  return arch.eval_resize


def write_checkpoint(out: str, model_def, variables: dict, spec: str, weights: str,
                     class_names: list[str] | None = None,
                     eval_resize: str | None = None) -> dict:
  """Saves {'params', 'extra'} and a meta describing the model as checkpoint step 0; the
  meta's eval_resize is `eval_resize`, else the source library's (source_eval_resize)."""
  arch = get_arch(spec)
  out = os.path.abspath(out)
  _check_out_folder(out)
  cfg = model_def.config()
  meta = {
      "version": checkpoint.META_VERSION,
      "model": cfg,
      "compute_dtype": "float32",
      "num_classes": int(model_def.kwargs["num_classes"]),
      "class_names": list(class_names or ()),
      "dataset": spec,
      "data": {"image_size": int(cfg.get("image_size") or 224), "normalize": arch.normalize,
               "eval_resize": eval_resize or source_eval_resize(spec, weights)},
      "objective": {"name": "softmax", "label_smoothing": 0.0},
      "source": {"from": spec, "weights": os.path.basename(weights)},
  }
  device = jax.local_devices()[0]
  arrays = jax.tree.map(lambda x: jax.device_put(np.asarray(x), device), variables)
  with ocp.CheckpointManager(out, options=ocp.CheckpointManagerOptions(
      create=True, enable_async_checkpointing=False)) as manager:
    manager.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(arrays),
                                            meta=ocp.args.JsonSave(meta)))
  return meta


def _check_out_folder(out: str) -> None:
  """An import's --out: a new or empty folder that takes files."""
  if os.path.isdir(out) and os.listdir(out):
    raise ValueError(f"--out={out} is not empty; give a new directory")
  out_paths.folder(out)


def import_weights(spec: str, weights: str, out: str, *, num_classes: int | None = None,
                   image_size: int | None = None, class_names: str | None = None,
                   eval_resize: str | None = None) -> dict:
  """Converts a timm / torchvision weight file into a bigpretrain checkpoint; its meta.
  `class_names`: a file naming the head's classes (teachers and infer compare them with
  their dataset's); without it the meta has none. `eval_resize`: the meta's data.eval_resize
  (default: the library's published eval transform of the weights, source_eval_resize)."""
  get_arch(spec)
  for flag, value, what in (("--num_classes", num_classes, "classes of the new head"),
                            ("--image_size", image_size, "the input's side in pixels")):
    if value is not None and (not isinstance(value, int) or value < 1):
      raise ValueError(f"{flag}={value!r} must be an int >= 1 ({what}).")
  if eval_resize is not None:
    augment_spec.eval_resize_op(eval_resize, "--eval_resize")
  _check_weight_file(weights)  # Before --out is made: a refused import leaves no folder.
  _check_out_folder(os.path.abspath(out))
  model_def, variables, _ = to_bigpretrain(read_state_dict(weights), spec,
                                           num_classes=num_classes, image_size=image_size)
  names = (read_class_names(class_names, int(model_def.kwargs["num_classes"]))
           if class_names else None)
  return write_checkpoint(out, model_def, variables, spec, weights, names, eval_resize)


def from_bigpretrain(variables: dict, model_def, spec: str) -> dict[str, np.ndarray]:
  """{'params', 'extra'} of `model_def` -> the state dict of `spec`'s source library."""
  arch = get_arch(spec)
  cfg = model_def.config()
  if cfg["name"] != arch.model:
    raise ValueError(f"the checkpoint's model is {cfg['name']!r}; {spec} is {arch.model!r}")
  target = {"name": arch.model, **arch.options}
  for k in ("image_size", "pre_logits"):
    if k in cfg:
      target[k] = cfg[k]
  num_classes = int(model_def.kwargs["num_classes"])
  if any(cfg.get(k) != v for k, v in target.items()):  # else the checkpoint's model is it
    model_def = _model_def(target, num_classes)
  expected = expected_tensors(arch, model_def)
  ours = {k: np.asarray(v) for k, v in _flat(variables).items()}
  names = {path: key for key, (path, _) in expected.items()}
  for path in ours:
    if path not in names:
      raise ValueError(f"the checkpoint does not match {spec}: it has {path!r}, which "
                       f"{spec} does not (model options {cfg})")
  sd = {}
  for key, (path, shape) in expected.items():
    if path not in ours:
      raise ValueError(f"the checkpoint does not match {spec}: it lacks {path!r} ({key!r})")
    x = np.ascontiguousarray(to_torch_layout(path.split("/", 1)[1], ours[path]))
    if x.shape != shape:
      raise ValueError(f"the checkpoint does not match {spec}: {path!r} gives {key!r} of "
                       f"shape {x.shape}, expected {shape}")
    sd[key] = x
    if key.endswith(".running_mean"):
      sd[key[:-len("running_mean")] + "num_batches_tracked"] = np.zeros((), np.int64)
  return sd


def export_weights(ckpt: str, out: str, spec: str | None = None) -> dict[str, np.ndarray]:
  """Writes a bigpretrain checkpoint's weights as `spec`'s state dict (.safetensors, or .pth
  with torch). `spec` defaults to the layout the checkpoint was converted from."""
  from bigpretrain.models import pretrained  # pylint: disable=import-outside-toplevel
  _state_dict_format(out)
  out_paths.file(out)
  loaded = pretrained.load(ckpt)
  spec = spec or loaded.meta.get("source", {}).get("from")
  if not spec:
    raise ValueError(f"{ckpt} was not converted from a timm / torchvision file: give "
                     "--to=FORMAT:ARCH")
  sd = from_bigpretrain(jax.device_get(loaded.variables), loaded.model_def, spec)
  warn_bad_values(sd)
  trained, expects = loaded.meta["data"]["normalize"], get_arch(spec).normalize
  if trained != expects:
    console.warn(f"{ckpt}'s model takes inputs normalised as {trained!r}; {spec}'s "
                 f"models are fed {expects!r} by their library: give it {trained!r} inputs, "
                 "or its outputs will be off.")
  write_state_dict(sd, out)
  return sd


def write_state_dict(sd: dict[str, np.ndarray], out: str) -> None:
  """Writes a state dict as .safetensors (numpy API, no torch) or a torch pickle."""
  if _state_dict_format(out) == "safetensors":
    _import_safetensors().save_file(sd, out)
  else:
    torch = _import_torch()
    torch.save({k: torch.from_numpy(v.copy()) for k, v in sd.items()}, out)


def _state_dict_format(out: str) -> str:
  """'safetensors' or 'torch', by the file name `out` (a ValueError for another)."""
  suffix = os.path.splitext(out)[1].lower()
  if suffix == ".safetensors":
    return "safetensors"
  if suffix in PICKLE_SUFFIXES:
    return "torch"
  raise ValueError(f"--out={out}: expected a .safetensors or {'/'.join(PICKLE_SUFFIXES)} "
                   "file name")
