"""Command line of the offline data preparation jobs (Apache Beam): tfds ArrayRecord datasets,
and the semi-supervised selection index.

  python -m input_pipeline.prepare imagenet21k_p --manual_dir=RAW --data_dir=OUT \
      [--beam_runner=...] [--min_images=500] [--val_per_class=50] [--image_size=224] \
      [--jpeg_quality=75]
  python -m input_pipeline.prepare folder --manual_dir=RAW --data_dir=OUT --name=NAME \
      [--val_per_class=0] [--min_images=1] [--image_size=S] [--jpeg_quality=75]
  python -m input_pipeline.prepare selection --predictions=DIR --k=K --data_dir=OUT \
      [--variant=balanced_ranked|unbalanced_ranked|balanced_with_tags] \
      [--class_sizes=SIZES.json | --zipf_total=T [--zipf_exponent=1.0]] [--seed=0] \
      [--expected_classes=CLASSES.txt] [--exclude=FILE]
  python -m input_pipeline.prepare hashtags --manual_dir=RAW --data_dir=OUT [--name=NAME] \
      [--min_count=1] [--min_raw_count=2] [--tail_threshold=5000] [--image_size=keep] \
      [--max_pixels=N]

imagenet21k_p: input_pipeline/jobs/imagenet21k_p.py (the paper's three steps); folder: any
ImageFolder tree, input_pipeline/jobs/image_folder.py. Train on the result with
`--config.data.name=imagenet21k_p` (or `folder:NAME`) and `--config.data.dir=OUT`.
selection: the semi-supervised recipe's top-K selection of D-hat from teacher predictions, an
index into the source dataset (input_pipeline/jobs/selection_job.py, which documents both formats).
hashtags: a SWAG hashtag dataset from WebDataset shards and JSONL/Parquet manifests
(input_pipeline/jobs/hashtag_job.py), read as `--config.data.name=hashtags:NAME`.

Beam's FnApiRunner runs the job on this machine; --beam_runner picks another (DataflowRunner,
FlinkRunner, SparkRunner, input_pipeline.jobs.dask_runner.DaskRunner). Flags this command does not
define are handed to Beam as pipeline options, e.g. `--direct_num_workers=8
--direct_running_mode=multi_processing` (all local cores), or `--project=P --region=R
--temp_location=gs://... --setup_file=./setup.py` (Dataflow); docs/data.md lists each runner's.
A finished dataset in OUT is reused, not regenerated. Prints a summary at the end.

Subcommands, as `tfds build` has them: argparse through absl's argparse_flags, run by absl's
app, so absl's own flags (--verbosity, --log_dir, --flagfile) work as in every other command.
"""
import argparse
import functools
import os
from typing import Sequence

from absl import app
from absl import flags
from absl import logging
from absl.flags import argparse_flags
from apache_beam.options import pipeline_options
from apache_beam.runners import runner as runner_lib

from bigpretrain.tools import cli
from input_pipeline.jobs import beam_images
from input_pipeline.jobs import hashtag_job
from input_pipeline.sources import hashtag_source
from input_pipeline.jobs import image_folder
from input_pipeline.jobs import imagenet21k_p
from input_pipeline.jobs import selection_job


RUNNER_HELP = ("Beam runner: DataflowRunner, FlinkRunner, SparkRunner, "
               "input_pipeline.jobs.dask_runner.DaskRunner or a runner class's full name; its "
               "options are passed as --key=value flags (docs/data.md). Default: Beam's "
               "FnApiRunner on this machine.")


def _size(text: str) -> int | None:
  return None if text.lower() in ("", "none", "keep") else int(text)


def build_parser(absl_flags: flags.FlagValues | None = None) -> argparse.ArgumentParser:
  """The command's parser; it also takes `absl_flags` (the command's: absl.flags.FLAGS)."""
  parser_class = functools.partial(argparse_flags.ArgumentParser,
                                   inherited_absl_flags=absl_flags)
  parser = parser_class(
      prog="python -m input_pipeline.prepare",
      description="Prepare a dataset with Apache Beam into tfds ArrayRecord files. Unknown "
      "--flags are passed to Beam as pipeline options.")
  sub = parser.add_subparsers(dest="dataset", required=True, parser_class=parser_class)

  def common(p, min_images, val_per_class, image_size):
    p.add_argument("--manual_dir", required=True, help="Raw data folder.")
    p.add_argument("--data_dir", required=True, help="tfds data dir to write into.")
    p.add_argument("--beam_runner", default=None, help=RUNNER_HELP)
    p.add_argument("--min_images", type=int, default=min_images,
                   help="Keep a class only if it has at least this many files.")
    p.add_argument("--val_per_class", type=int, default=val_per_class,
                   help="Validation images per class (sha256 rule).")
    p.add_argument("--image_size", type=_size, default=image_size,
                   help="Squish side; 'keep' (or none) keeps sizes.")
    p.add_argument("--jpeg_quality", type=int, default=beam_images.JPEG_QUALITY,
                   help="Quality of re-encoded JPEGs.")

  p21k = sub.add_parser("imagenet21k_p", help="ImageNet-21K-P from the raw ImageNet-21K.")
  common(p21k, imagenet21k_p.MIN_IMAGES, imagenet21k_p.VAL_PER_CLASS, imagenet21k_p.IMAGE_SIZE)
  pfolder = sub.add_parser("folder", help="Any ImageFolder tree, as folder:NAME.")
  common(pfolder, 1, 0, None)
  pfolder.add_argument("--name", required=True, help="Dataset name (read as folder:NAME).")

  psel = sub.add_parser("selection", help="Top-K per class selection of D-hat from teacher "
                        "predictions (semi-supervised recipe).")
  psel.add_argument("--predictions", required=True,
                    help="Folder of prediction shards and predictions.json.")
  psel.add_argument("--data_dir", required=True, help="Folder to write D-hat's index into.")
  psel.add_argument("--beam_runner", default=None, help=RUNNER_HELP)
  psel.add_argument("--variant", default="balanced_ranked", choices=selection_job.VARIANTS)
  psel.add_argument("--k", type=int, default=None,
                    help="Images per class (balanced_ranked, balanced_with_tags).")
  psel.add_argument("--class_sizes", default=None,
                    help="unbalanced_ranked: JSON file {class name: K}; absent classes get 0.")
  psel.add_argument("--zipf_total", type=int, default=None,
                    help="unbalanced_ranked: Zipf per-class K summing to this total.")
  psel.add_argument("--zipf_exponent", type=float, default=1.0, help="Zipf exponent.")
  psel.add_argument("--seed", type=int, default=0,
                    help="Zipf class order (unbalanced_ranked), random draw (with_tags).")
  psel.add_argument("--expected_classes", default=None,
                    help="Text file, one class name a line: the class list the teacher must "
                    "have.")
  psel.add_argument("--exclude", default=None,
                    help="Exclusion list (the dedup command's exclusions.tsv): its images are "
                    "never selected.")
  psel.add_argument("--batch_size", type=int, default=selection_job.BATCH_SIZE,
                    help="Prediction rows read per batch.")

  ptags = sub.add_parser("hashtags", help="A SWAG hashtag dataset from crawled WebDataset "
                         "shards and JSONL/Parquet manifests, as hashtags:NAME.")
  ptags.add_argument("--manual_dir", required=True, help="Folder of shards and manifests.")
  ptags.add_argument("--data_dir", required=True, help="tfds data dir to write into.")
  ptags.add_argument("--name", default="hashtags",
                     help="Dataset name (read as hashtags:NAME); 'demo' is reserved.")
  ptags.add_argument("--beam_runner", default=None, help=RUNNER_HELP)
  ptags.add_argument("--min_count", type=int, default=hashtag_job.MIN_COUNT,
                     help="Keep a canonical hashtag only if at least this many train images "
                     "have it.")
  ptags.add_argument("--min_raw_count", type=int, default=hashtag_job.MIN_RAW_COUNT,
                     help="Keep a raw hashtag only if at least this many train images have "
                     "it (paper: used more than once).")
  ptags.add_argument("--tail_threshold", type=int, default=hashtag_job.TAIL_THRESHOLD,
                     help="Head = canonical hashtags in at least this many train images.")
  ptags.add_argument("--image_size", type=_size, default=None,
                     help="Squish side; 'keep' (default) keeps the images as they are.")
  ptags.add_argument("--jpeg_quality", type=int, default=beam_images.JPEG_QUALITY,
                     help="Quality of re-encoded JPEGs.")
  ptags.add_argument("--max_pixels", type=int, default=hashtag_job.MAX_PIXELS,
                     help="Skip images whose header declares more pixels (bombs).")
  return parser


def run_hashtags(args, beam_options) -> str:
  """The hashtags subcommand: runs it and returns its summary."""
  name = image_folder.check_name(args.name)
  if name == hashtag_source.DEMO_NAME:
    raise ValueError("--name=demo is reserved for hashtags:demo (made from the demo dataset);"
                     " choose another name.")
  builder = hashtag_job.prepare(
      args.manual_dir, args.data_dir, name, min_count=args.min_count,
      min_raw_count=args.min_raw_count, tail_threshold=args.tail_threshold,
      image_size=args.image_size, jpeg_quality=args.jpeg_quality, max_pixels=args.max_pixels,
      beam_runner=args.beam_runner, beam_options=beam_options)
  return hashtag_job.summary(builder)


def _read_lines(path: str) -> list[str]:
  with open(path, encoding="utf-8") as f:
    return [line.strip() for line in f if line.strip()]


def run_selection(args, beam_options) -> str:
  """The selection subcommand: runs it and returns its summary."""
  class_sizes = (selection_job.read_class_sizes(args.class_sizes)
                 if args.class_sizes else None)
  expected = _read_lines(args.expected_classes) if args.expected_classes else None
  info = selection_job.prepare(
      args.predictions, args.data_dir, k=args.k, variant=args.variant, class_sizes=class_sizes,
      zipf_total=args.zipf_total, zipf_exponent=args.zipf_exponent, seed=args.seed,
      expected_class_names=expected, beam_runner=args.beam_runner, beam_options=beam_options,
      batch_size=args.batch_size, exclude=args.exclude)
  return selection_job.summary(info, args.data_dir)


def summary(builder) -> str:
  """Human-readable summary of a prepared dataset and its preparation report."""
  meta = imagenet21k_p.report(builder)
  splits = {s: builder.info.splits[s].num_examples for s in sorted(builder.info.splits.keys())}
  dropped = meta.get("dropped_classes", {})
  corrupt = meta.get("corrupt_files", [])
  params = meta.get("params", {})
  lines = [
      f"Dataset {builder.info.full_name} in {builder.data_dir}",
      f"  examples: {splits}",
      f"  classes: {builder.info.features['label'].num_classes} kept; {len(dropped)} dropped "
      f"with {'<' if params.get('class_rule') else '<='} {params.get('min_images')} files"
      + (f", e.g. {dict(list(dropped.items())[:5])}" if dropped else ""),
      f"  corrupt/unreadable files skipped: {len(corrupt)}"
      + (f", e.g. {corrupt[:3]}" if corrupt else ""),
  ]
  if meta.get("unreadable_classes"):
    lines.append(f"  unreadable class sources: {meta['unreadable_classes']}")
  if meta.get("counters"):
    lines.append(f"  Beam counters: {meta['counters']}")
  lines.append(f"  full report: {builder.data_dir}/metadata.json")
  return "\n".join(lines)


def check_beam_flags(beam_runner: str | None, beam_options: Sequence[str]) -> None:
  """ValueError naming an unknown runner, or the flags that no Beam pipeline option defines
  (Beam would drop them with a warning and run with its defaults, e.g. on a local cluster)."""
  if beam_runner:
    try:
      runner_lib.create_runner(beam_runner)  # Imports the runner's module: its options too.
    except (ValueError, ImportError) as e:
      raise ValueError(f"--beam_runner={beam_runner}: {e}") from e
  options = pipeline_options.PipelineOptions(list(beam_options))
  unknown = sorted(set(options.get_all_options(retain_unknown_options=True))
                   - set(options.get_all_options()))
  if unknown:
    raise ValueError(f"Neither this command nor Beam (runner {beam_runner or 'FnApiRunner'}) "
                     f"defines {['--' + u for u in unknown]}; docs/data.md lists each "
                     "runner's options.")


def main(argv: Sequence[str] | None = None) -> int:
  """Parses argv (without the program name), runs the job, prints the summary."""
  return run(build_parser().parse_known_args(argv))


def run(parsed: tuple[argparse.Namespace, list[str]]) -> int:
  """Runs the job of parsed arguments (the namespace, the flags handed to Beam)."""
  args, beam_options = parsed
  bad = [a for a in beam_options if not a.startswith("--")]
  if bad:
    raise ValueError(f"Unexpected arguments {bad}; Beam options must look like --key=value.")
  check_beam_flags(args.beam_runner, beam_options)
  if os.path.exists(args.data_dir) and not os.path.isdir(args.data_dir):
    raise ValueError(f"--data_dir={args.data_dir} is a file: give the folder to write into.")
  if beam_options:
    logging.info("Passing to Beam: %s", beam_options)
  if args.dataset == "selection":
    print(run_selection(args, beam_options), flush=True)
    return 0
  if args.dataset == "hashtags":
    print(run_hashtags(args, beam_options), flush=True)
    return 0
  kwargs = dict(beam_runner=args.beam_runner, beam_options=beam_options,
                min_images=args.min_images, val_per_class=args.val_per_class,
                image_size=args.image_size, jpeg_quality=args.jpeg_quality)
  if args.dataset == "imagenet21k_p":
    if args.image_size is None:
      raise ValueError("imagenet21k_p always squishes images; give --image_size as an int.")
    builder = imagenet21k_p.prepare(args.manual_dir, args.data_dir, **kwargs)
  else:
    builder = image_folder.prepare(args.manual_dir, args.data_dir, args.name, **kwargs)
  print(summary(builder), flush=True)
  return 0


def _parse_flags(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  return build_parser(flags.FLAGS).parse_known_args(argv[1:])


def _command(parsed) -> int:
  with cli.user_errors():  # A missing folder or a bad value: one line.
    return run(parsed)


if __name__ == "__main__":
  flags.FLAGS.verbosity = logging.INFO  # The jobs' progress; --verbosity overrides it.
  app.run(_command, flags_parser=_parse_flags)
