"""A call's dropout state: the keep threshold and scale of a probability, and the Philox (seed,
offset) drawn from PyTorch's CUDA generator, carried from a forward to its backward."""
from __future__ import annotations

import typing

import torch


def dropout_threshold_and_scale(dropout_p: float) -> tuple[int, float]:
    """(threshold, scale) for dropout_p: a probability is kept iff its random byte is below the
    threshold, round((1 - p) * 256), so with probability threshold / 256, and kept ones are scaled
    by 256 / threshold. The expected output is then exactly the undropped one; 1 / (1 - p) would be
    off by up to 0.2% (p = 0.1 keeps 230 / 256 = 0.8984)."""
    if dropout_p <= 0.0:
        return 256, 1.0
    threshold = min(256, max(0, round((1.0 - dropout_p) * 256)))
    return threshold, (256.0 / threshold if threshold else 0.0)


class DropoutState(typing.NamedTuple):
    """A call's dropout: probability and the Philox (seed, offset) it draws with."""

    p: float
    seed: int
    offset: int

    def params(self) -> dict:
        threshold, scale = dropout_threshold_and_scale(self.p)
        return dict(philox_seed=self.seed, philox_offset=self.offset, dropout_threshold=threshold,
                    rp_dropout=scale)

    def rng_state(self) -> torch.Tensor:
        return torch.tensor([self.seed, self.offset], dtype=torch.int64)


NO_DROPOUT = DropoutState(0.0, 0, 0)
NO_DROPOUT_PARAMS = NO_DROPOUT.params()  # packed by every forward without dropout: computed once
# Philox offsets one call reserves from PyTorch's generator (its unit: 4 values per thread).
PHILOX_OFFSET_STEP = 4


def draw_dropout(dropout_p: float, device_index_: int) -> DropoutState:
    """Take (seed, offset) from the device's default CUDA generator and advance its offset, as
    flash_attn does: torch.manual_seed makes the masks reproducible."""
    if dropout_p <= 0.0:
        return NO_DROPOUT
    generator = torch.cuda.default_generators[device_index_]
    seed = generator.initial_seed()
    offset = generator.get_offset()
    generator.set_offset(offset + PHILOX_OFFSET_STEP)
    if seed >= 2**63:  # the params field is a signed 64-bit integer: keep the bits
        seed -= 2**64
    return DropoutState(float(dropout_p), seed, offset)


def dropout_from_rng_state(dropout_p: float, rng_state: torch.Tensor) -> DropoutState:
    if dropout_p <= 0.0:
        return NO_DROPOUT
    seed, offset = rng_state.tolist()
    return DropoutState(float(dropout_p), seed, offset)
