"""Model registry: build any model by name with `get_model(name, num_classes=..., rngs=...)`.

Every model is a Flax NNX module called as `model(images, *, train=False, rng=None)` and
returning float32 logits [B, num_classes]. A registered factory is a callable taking
`num_classes`, `rngs` and keyword options; a functools.partial over a model class fixes the
architecture (its bound keywords cannot be overridden through get_model).
"""
import dataclasses
import functools
import inspect

from flax import nnx
import jax
import jax.numpy as jnp

from bigpretrain.models import base
from bigpretrain.models import layers
from bigpretrain.runtime import tracer_sharding

tracer_sharding.install()  # Tracing an NNX model stays linear in its size.

_RESERVED = ("num_classes", "rngs")
register = base.MODELS.register


def list_models() -> list[str]:
  """Sorted names of all registered models."""
  return base.MODELS.names()


def _accepted_kwargs(factory) -> tuple[set[str] | None, set[str]]:
  """(accepted option names or None when the factory takes **kwargs, fixed names)."""
  fixed = set()
  func = factory
  if isinstance(factory, functools.partial):
    fixed = set(factory.keywords)
    func = factory.func
  # A class's own signature is its metaclass's (*args, **kwargs) under nnx: read __init__.
  params = inspect.signature(func.__init__ if inspect.isclass(func) else func).parameters
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    return None, fixed
  names = {n for n, p in params.items()
           if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
  return names - fixed - set(_RESERVED) - {"self"}, fixed


def accepts(name: str, option: str) -> bool:
  """Whether registered model `name` takes keyword `option` (and does not fix it)."""
  accepted, fixed = (_accepted_kwargs(base.MODELS.get(name)) if name in base.MODELS
                     else (set(), set()))
  return option not in fixed and (accepted is None or option in accepted)


def get_model(name: str, *, num_classes: int, rngs: nnx.Rngs, remat: str = "",
              attention_impl: str = "xla", head_dtype: str = "float32",
              grouped_conv_impl: str = "xla", pointwise_conv_impl: str = "xla",
              platform: str | None = None,
              **kw) -> nnx.Module:
  """Builds the registered model `name` with `num_classes` outputs.

  `remat` (config.model.remat) names a jax.checkpoint_policies policy each residual block is
  rematerialised with (base.remat_blocks); '' or 'none' = off. `attention_impl`,
  `head_dtype`, `grouped_conv_impl` and `pointwise_conv_impl` (config.model's) pick
  kernels, not weights (base.set_kernels; attention 'auto': base.auto_attention's pick for
  `platform`, default JAX's default backend, and the model's `dtype`). Raises ValueError for
  an unknown name (listing the registered ones) and TypeError for an option the model does
  not take or one fixed by its architecture.
  """
  factory = base.MODELS.get(name)
  accepted, fixed = _accepted_kwargs(factory)
  bad_fixed = sorted(set(kw) & fixed)
  if bad_fixed:
    raise TypeError(f"model {name!r}: option(s) {bad_fixed} are fixed by the architecture")
  if accepted is not None:
    unknown = sorted(set(kw) - accepted)
    if unknown:
      raise TypeError(f"model {name!r} got unknown option(s) {unknown}; "
                      f"accepted: {sorted(accepted)}")
  model = factory(num_classes=num_classes, rngs=rngs, **kw)
  if attention_impl == "auto":
    attention_impl = base.auto_attention(model, platform or jax.default_backend(),
                                         kw.get("dtype", jnp.float32))
  model = base.set_kernels(model, attention_impl, head_dtype, grouped_conv_impl,
                           pointwise_conv_impl)
  return base.remat_blocks(model, remat)


@dataclasses.dataclass
class ModelDef:
  """A registered model with its options: builds, splits and merges it for jitted steps.

  The trainer keeps params and the rest of the model state ('extra', e.g. BatchNorm
  statistics) as pure dicts; `merge` turns them back into a callable module inside jit.
  """
  name: str
  kwargs: dict
  graphdef: nnx.GraphDef
  abstract_params: nnx.State
  abstract_extra: nnx.State

  @classmethod
  def from_config(cls, model_cfg, num_classes: int, compute_dtype: str = "float32",
                  image_size: int | None = None, platform: str | None = None):
    """From a `config.model`-style mapping: 'name' plus the model's keyword options.
    `image_size` (config.data.image_size) fills the model's image_size option if unset.
    attention_impl='auto' (also where the mapping has none, as the configs' default) becomes
    base.auto_attention's kernel for `platform` (the devices' platform, e.g. a mesh's;
    default: JAX's default backend)."""
    kwargs = {k: v for k, v in model_cfg.items() if k != "name"}
    if image_size is not None and "image_size" not in kwargs and accepts(model_cfg["name"],
                                                                         "image_size"):
      kwargs["image_size"] = image_size
    kwargs["dtype"] = jnp.dtype(compute_dtype)
    kwargs["num_classes"] = num_classes
    kwargs.setdefault("attention_impl", "auto")
    abstract = nnx.eval_shape(lambda: get_model(model_cfg["name"], rngs=nnx.Rngs(0),
                                                platform=platform, **kwargs))
    if kwargs["attention_impl"] == "auto":  # The kernel get_model picked, for create().
      kwargs["attention_impl"] = base.auto_attention(
          abstract, platform or jax.default_backend(), compute_dtype)
    graphdef, params, extra = nnx.split(abstract, nnx.Param, ...)
    return cls(model_cfg["name"], kwargs, graphdef, params, extra)

  def create(self, rng):
    """Concrete (params, extra) as pure dicts."""
    model = get_model(self.name, rngs=nnx.Rngs(rng), **self.kwargs)
    _, params, extra = nnx.split(model, nnx.Param, ...)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(extra)

  def merge(self, params, extra):
    return nnx.merge(self.graphdef, params, extra)

  def config(self) -> dict:
    """The `config.model` mapping that rebuilds this model (a checkpoint's meta). Without
    the run's compute settings (`remat`, `attention_impl`, `head_dtype`,
    `grouped_conv_impl`, `pointwise_conv_impl`): how a run trades compute for memory or picks
    kernels is not part of its weights."""
    runtime = ("dtype", "num_classes", "remat", "attention_impl", "head_dtype",
               "grouped_conv_impl", "pointwise_conv_impl")
    return {"name": self.name, **{k: v for k, v in self.kwargs.items() if k not in runtime}}

  def for_model_flops(self) -> "ModelDef":
    """This model as MFU counts its FLOPs: XLA's kernels (attention_impl and
    grouped_conv_impl 'xla') and no rematerialisation; the same function and parameters.
    Another kernel may compute more (cuDNN's attention runs ViT's pad token, a GEMM grouped
    convolution multiplies the padding in its input gradient; a GEMM 1x1 convolution computes
    the model's FLOPs and keeps its form), and a rematerialised block runs its forward twice:
    hardware FLOPs, which MFU leaves out (PaLM, appendix B). Itself where it is that already."""
    reference = {"attention_impl": "xla", "grouped_conv_impl": "xla"}
    remat_off = layers.remat_policy(self.kwargs.get("remat", "")) is None
    if remat_off and all(self.kwargs.get(k, "xla") == v for k, v in reference.items()):
      return self
    module = base.set_kernels(self.abstract_module(), head_dtype=self.kwargs.get(
        "head_dtype", "float32"), pointwise_conv_impl=self.kwargs.get(
            "pointwise_conv_impl", "xla"), **reference)
    module = base.remat_blocks(module, "")
    graphdef, params, extra = nnx.split(module, nnx.Param, ...)
    return dataclasses.replace(self, kwargs={**self.kwargs, **reference, "remat": ""},
                               graphdef=graphdef, abstract_params=params,
                               abstract_extra=extra)

  def abstract_module(self) -> nnx.Module:
    """The model with shapes in place of arrays: its hooks (layer order, parameter
    adaptation) without weights."""
    return nnx.merge(self.graphdef, self.abstract_params, self.abstract_extra)

  def param_adapter(self, method: str, origin=lambda: ""):
    """`adapt(path, saved) -> array or None` for checkpoint.init_from: the model's
    adapt_param hook on a checkpoint path ('params/pos_embed'). `method` says how a
    position embedding is resized (vit.RESIZE_METHODS), or 'auto': as the library a
    converted checkpoint came from resizes it (`origin()`, its meta's source, read only when
    an array is adapted: timm, torchvision; vit.ORIGIN_RESIZE), 'bicubic' for any other."""
    if method != "auto" and method not in vit.RESIZE_METHODS:
      raise ValueError(f"config.model_init_resize={method!r} must be auto or one of "
                       f"{vit.RESIZE_METHODS}.")
    module = self.abstract_module()

    def adapt(path: str, saved):
      kind, _, inner = path.partition("/")
      if kind != "params":
        return None
      how = (vit.ORIGIN_RESIZE.get(origin().split(":", 1)[0], "bicubic") if method == "auto"
             else method)
      return module.adapt_param(inner, saved, how)

    return adapt

  def abstract_pure_params(self):
    return nnx.to_pure_dict(self.abstract_params)

  def abstract_pure_extra(self):
    return nnx.to_pure_dict(self.abstract_extra)


def load_pretrained(path: str) -> nnx.Module:
  """The model of a run's workdir, a checkpoint dir or a `bigpretrain.tools.convert` output, with
  its weights, on the first local device; call it with train=False (the default)."""
  # pretrained.py imports this package: imported at the call.
  from bigpretrain.models import pretrained  # pylint: disable=import-outside-toplevel
  return pretrained.load(path).module()


# The built-in architectures register their variants on import.
# pylint: disable=g-import-not-at-top,g-bad-import-order,unused-import,wrong-import-position
from bigpretrain.models import mixer
from bigpretrain.models import mobilenet_v3
from bigpretrain.models import regnet
from bigpretrain.models import resnet
from bigpretrain.models import tresnet
from bigpretrain.models import vit
