"""A raw ImageNet-21K-style folder of real photo crops, for the input pipeline's per-core
figure from JPEGs as `prepare imagenet21k_p` writes them (224 x 224, quality 75):

  python benchmarks/photo_set.py --out=RAW [--photos=DIR] [--per_class=550]
  python -m input_pipeline.prepare imagenet21k_p --manual_dir=RAW --data_dir=DATA
  python benchmarks/input_pipeline.py --data_dir=DATA \
      --augment='squish|cutout|randaugment(2, 9)' --workers=1

Photos: the colour photos of --photos (default: scikit-image's sample photos, its skimage/data
folder: astronaut, chelsea, coffee, rocket, the Hubble deep field, a stained tissue, a retina,
two motorcycle views). Each raw image is a random crop of one of them (a side between
PHOTO_CROP of the photo's shorter side and all of it, and at least the prepared size, aspect
3/4 to 4/3, mirrored half the time) saved as a JPEG at RAW_QUALITY, in one folder per class
of WNIDS (ImageNet classes, so that prepare keeps them). --per_class 550 gives prepare's
defaults (at least 500 images, 50 to validation) 500 train images per class: 2,000 in all.
"""
import argparse
import importlib.util
import os
import pathlib

import numpy as np
from PIL import Image

# scikit-image's colour photos (its other samples are grey, drawings or tiny).
SKIMAGE_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg",
                  "hubble_deep_field.jpg", "ihc.png", "retina.jpg", "motorcycle_left.png",
                  "motorcycle_right.png")
PHOTO_CROP = 0.3  # Smallest crop side, as a share of the photo's shorter side.
MIN_SIDE = 224  # Not below the prepared size: prepare squishes every image to it.
RAW_QUALITY = 90
WNIDS = ("n01440764", "n01443537", "n01484850", "n01491361")  # Tench, goldfish, two sharks.


def skimage_photos() -> list[pathlib.Path]:
  spec = importlib.util.find_spec("skimage")
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit("photo_set: scikit-image is not installed; `pip install scikit-image` "
                     "or give --photos=DIR, a folder of colour photos.")
  folder = pathlib.Path(list(spec.submodule_search_locations)[0]) / "data"
  return [folder / name for name in SKIMAGE_PHOTOS]


def load_photos(folder: str | None) -> list[np.ndarray]:
  """The colour photos as uint8 RGB arrays."""
  if folder:
    paths = sorted(p for p in pathlib.Path(folder).iterdir()
                   if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
  else:
    paths = skimage_photos()
  photos = []
  for path in paths:
    with Image.open(path) as image:
      if image.mode == "RGB" and min(image.size) >= MIN_SIDE:
        photos.append(np.asarray(image))
  if not photos:
    raise SystemExit(f"photo_set: no RGB photo of at least {MIN_SIDE} px a side in "
                     f"{folder or 'skimage/data'}.")
  return photos


def random_crop(photo: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  h, w = photo.shape[:2]
  shorter = min(h, w)
  side = int(rng.uniform(max(PHOTO_CROP * shorter, MIN_SIDE), shorter + 1))
  aspect = rng.uniform(3 / 4, 4 / 3)
  ch, cw = min(h, side), min(w, max(MIN_SIDE, int(side * aspect)))
  top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
  crop = photo[top:top + ch, left:left + cw]
  return crop[:, ::-1] if rng.random() < 0.5 else crop


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True, help="Raw folder to write (wnid folders).")
  parser.add_argument("--photos", default=None, help="Folder of colour photos (default: "
                      "scikit-image's sample photos).")
  parser.add_argument("--per_class", type=int, default=550)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  photos = load_photos(args.photos)
  wnids = WNIDS
  rng = np.random.default_rng(args.seed)
  for wnid in wnids:
    folder = pathlib.Path(args.out) / wnid
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(args.per_class):
      crop = random_crop(photos[int(rng.integers(len(photos)))], rng)
      Image.fromarray(np.ascontiguousarray(crop)).save(
          folder / f"{wnid}_{i}.JPEG", quality=RAW_QUALITY)
  print(f"{len(wnids) * args.per_class} crops of {len(photos)} photos in {len(wnids)} class "
        f"folders under {os.path.abspath(args.out)}")


if __name__ == "__main__":
  main()
