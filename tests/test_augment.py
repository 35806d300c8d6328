"""Batched per-sample augmentation: hand-computed crops and flips, draw frequencies, determinism."""

from __future__ import annotations

import torch

from fl_core.data import augment
from fl_core.data.augment import AugmentParams


def _img():
    return torch.arange(1.0, 10.0).view(1, 1, 3, 3)  # [[1,2,3],[4,5,6],[7,8,9]]


def test_offset_equal_to_padding_is_the_identity():
    p = AugmentParams(torch.tensor([False]), torch.tensor([1]), torch.tensor([1]))
    assert torch.equal(augment.apply(_img(), p, padding=1), _img())


def test_crop_from_the_zero_padded_image_by_hand():
    # offset (0, 0) with padding 1: the window starts one pixel up and left of the image
    p = AugmentParams(torch.tensor([False]), torch.tensor([0]), torch.tensor([0]))
    out = augment.apply(_img(), p, padding=1)
    assert torch.equal(out[0, 0], torch.tensor([[0.0, 0, 0], [0, 1, 2], [0, 4, 5]]))
    # offset (2, 1): one pixel down, no horizontal shift
    p = AugmentParams(torch.tensor([False]), torch.tensor([2]), torch.tensor([1]))
    out = augment.apply(_img(), p, padding=1)
    assert torch.equal(out[0, 0], torch.tensor([[4.0, 5, 6], [7, 8, 9], [0, 0, 0]]))


def test_flip_then_crop_per_sample():
    x = torch.cat([_img(), _img()])
    p = AugmentParams(torch.tensor([True, False]), torch.tensor([1, 1]), torch.tensor([1, 2]))
    out = augment.apply(x, p, padding=1)
    assert torch.equal(out[0, 0], torch.tensor([[3.0, 2, 1], [6, 5, 4], [9, 8, 7]]))
    assert torch.equal(out[1, 0], torch.tensor([[2.0, 3, 0], [5, 6, 0], [8, 9, 0]]))


def test_leading_client_dimension_is_handled():
    x = torch.randn(3, 4, 2, 5, 5)  # [C, B, channels, H, W]
    ps = [augment.draw("crop_flip", 4, 2, 0, 1, c, 1) for c in range(3)]
    out = augment.apply(x, augment.stack(ps), 2)
    for c in range(3):
        assert torch.equal(out[c], augment.apply(x[c], ps[c], 2))


def test_draw_frequencies_and_determinism():
    crop_flip = augment.draw("crop_flip", 20000, 4, 1, 2, 3, 4)
    assert abs(crop_flip.flip.float().mean().item() - 0.5) < 0.02
    assert crop_flip.dy.min() == 0 and crop_flip.dy.max() == 8
    fb = augment.draw("fedbug", 20000, 4, 1, 2, 3, 4)
    untouched = ((fb.dy == 4) & (fb.dx == 4)).float().mean().item()
    assert abs(untouched - (0.5 + 0.5 / 81)) < 0.02  # FedBug crops only half of the samples
    flip = augment.draw("flip", 20000, 4, 1, 2, 3, 4)
    assert bool(((flip.dy == 4) & (flip.dx == 4)).all()) and abs(flip.flip.float().mean().item() - 0.5) < 0.02
    again = augment.draw("fedbug", 20000, 4, 1, 2, 3, 4)
    assert torch.equal(fb.dy, again.dy) and torch.equal(fb.flip, again.flip)
    other = augment.draw("fedbug", 20000, 4, 1, 2, 3, 5)
    assert not torch.equal(fb.dy, other.dy)


def test_augmentation_changes_training(digits):
    from conftest import run_sim

    _, plain = run_sim(digits, "train.rounds=1")
    _, aug = run_sim(digits, "train.rounds=1", "train.augmentation=crop_flip", "train.crop_padding=2")
    assert not torch.equal(plain.final_flat, aug.final_flat)
