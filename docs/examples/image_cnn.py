"""Your own model and data, end to end: a small CNN on a folder of images, under ring all-reduce and ASP.

    pslab compare --set workload.name=docs/examples/image_cnn.py:make_workload \
        --strategies allreduce,ps-asp --no-straggler

The first call writes the images it trains on — `shapes/<class>/<n>.png` in the working directory, 16x16
grayscale, two classes (a horizontal or a vertical bar at a random place, with noise), seeded, so every process
reads the same files — then reads them back with `image_folder` as a user's own folder would be read (nothing
downloaded, nothing unpickled). `make_workload` is what the config names; pslab imports this file in every rank.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pslab.experiments.workloads.user import UserWorkload, image_folder

FOLDER = Path("shapes")
PER_CLASS = 200


def write_images(folder: Path = FOLDER, per_class: int = PER_CLASS, seed: int = 0) -> Path:
    """The image folder, made once: written in a temporary folder and renamed into place, so processes that start
    at the same moment never read a half-written one (the loser of the race uses the winner's)."""
    if folder.is_dir():
        return folder
    from PIL import Image
    rng = np.random.default_rng(seed)
    tmp = Path(tempfile.mkdtemp(prefix=".shapes-", dir=folder.parent if str(folder.parent) else "."))
    for label, cls in enumerate(("horizontal", "vertical")):
        (tmp / cls).mkdir()
        for n in range(per_class):
            img = rng.normal(0.2, 0.1, (16, 16))
            k = rng.integers(2, 14)
            if label == 0:
                img[k - 1: k + 1, 2:14] += 0.7
            else:
                img[2:14, k - 1: k + 1] += 0.7
            Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8)).save(tmp / cls / f"{n}.png")
    try:
        os.rename(tmp, folder)
    except OSError:                              # another process got there first: same seed, same images
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 2))


def make_workload() -> UserWorkload:
    train, test = image_folder(write_images(), grayscale=True)
    return UserWorkload(model=model, train=train, test=test, description="a CNN on generated bar images")
