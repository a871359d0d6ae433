r"""Weight import and export: timm / torchvision state dicts <-> bigpretrain checkpoints.

  python -m bigpretrain.tools.convert --from=timm:vit_base_patch16_224_miil_in21k \
      --weights=vit_miil_21k.pth --out=DIR [--num_classes=N] [--image_size=S] \
      [--class_names=FILE] [--eval_resize=center_crop(F[, bicubic])]
  python -m bigpretrain.tools.convert --export --weights=DIR --out=FILE.safetensors|.pth \
      [--to=FORMAT:ARCH]

What it computes and why: bigpretrain/models/convert.py.
"""

from absl import app
from absl import flags

from bigpretrain.models import convert
from bigpretrain.runtime import distributed
from bigpretrain.tools import cli


def define_flags(flag_values=flags.FLAGS) -> None:
  """The command's flags; defined only when it runs (as bigpretrain.tools.infer / dedup do)."""
  f = dict(flag_values=flag_values)
  flags.DEFINE_string("from", None, "Import: the source layout FORMAT:ARCH, e.g. "
                      "timm:vit_base_patch16_224_miil_in21k or torchvision:vit_b_16.", **f)
  flags.DEFINE_string("to", None, "Export: the target layout FORMAT:ARCH (default: the "
                      "layout the checkpoint was converted from).", **f)
  flags.DEFINE_string("weights", None, "Import: a .safetensors / .pth weight file. Export: "
                      "a bigpretrain run workdir or checkpoint dir.", **f)
  flags.DEFINE_string("out", None, "Import: a new checkpoint dir. Export: the file to write "
                      "(.safetensors, or .pth with torch).", **f)
  flags.DEFINE_integer("num_classes", None, "Import: classes of the new head (default: the "
                       "weights'); another count re-initialises it.", **f)
  flags.DEFINE_integer("image_size", None, "Import: the input size (ViT position embeddings "
                       "are resized to it).", **f)
  flags.DEFINE_string("class_names", None, "Import: a text file with the head's class names "
                      "(e.g. wnids), one per line.", **f)
  flags.DEFINE_string("eval_resize", None, "Import: the checkpoint's data.eval_resize, e.g. "
                      "center_crop(0.9, bicubic) (default: the source library's eval "
                      "transform of the weights).", **f)
  flags.DEFINE_bool("export", False, "Export a bigpretrain checkpoint instead.", **f)


def run(f) -> None:
  """The command on parsed flag values `f`; a bad input prints ERROR and exits 1."""
  if not f["weights"].value or not f["out"].value:
    cli.usage_error("--weights and --out are required.")
  with cli.user_errors(ImportError):
    if f["export"].value:
      sd = convert.export_weights(f["weights"].value, f["out"].value, f["to"].value)
      print(f"Wrote {len(sd)} tensors to {f['out'].value}")
    else:
      if not f["from"].value:
        cli.usage_error("--from=FORMAT:ARCH is required.")
      meta = convert.import_weights(f["from"].value, f["weights"].value, f["out"].value,
                            num_classes=f["num_classes"].value,
                            image_size=f["image_size"].value,
                            class_names=f["class_names"].value,
                            eval_resize=f["eval_resize"].value)
      print(f"Wrote {meta['model']['name']} ({meta['num_classes']} classes, "
            f"{meta['data']['image_size']} px, normalize={meta['data']['normalize']}, "
            f"eval_resize={meta['data']['eval_resize']}) to "
            f"{f['out'].value}")


def main(argv):
  if len(argv) > 1:
    cli.usage_error(f"Unexpected arguments {argv[1:]}.")
  cli.quiet_logs()
  distributed.select_platforms()
  run(flags.FLAGS)


if __name__ == "__main__":
  define_flags()
  app.run(main)
