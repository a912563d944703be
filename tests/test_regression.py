"""Pinned numbers (as torchtune pins its recipes): four seeded fp32 steps of the `tiny` preset on the builtin
text. A change to data order, initialisation, loss normalisation, clipping or the schedule moves them."""

import pytest

import nbtrain as nbt

# (loss, grad_norm, lr) per step, measured on CPU with torch 2.13 (2026-12-01).
PINNED = [
    (7.640973091125488, 2.528045177459717, 1e-3),
    (7.570214748382568, 2.2556424140930176, 8.535533905932737e-4),
    (7.4757080078125, 1.6015701293945312, 5e-4),
    (7.394354343414307, 1.6292901039123535, 1.4644660940672628e-4),
]


def test_four_tiny_fp32_steps_are_pinned():
    cfg = nbt.TrainConfig(model="tiny", data="builtin:python-docs", subset=64, max_seq_len=48,
                          micro_batch_size=8, max_steps=4, eval_fraction=0.0, precision="fp32", lr=1e-3, seed=0)
    got = nbt.train(cfg).history[["loss", "grad_norm", "lr"]].values.tolist()
    for step, (row, pinned) in enumerate(zip(got, PINNED), start=1):
        # Kernels may sum in another order on another CPU; a real change moves the loss by far more than this.
        assert row == pytest.approx(pinned, rel=2e-4), f"step {step}: {row} != pinned {pinned}"
