"""The digits data both MXNet examples use: scikit-learn's bundled 8x8 digits, split and sharded per rank."""

from __future__ import annotations

import numpy as np


def digits(seed: int, test_fraction: float = 0.2) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Seeded stratified split of the 1797 digits as standardised float32 rows of 64 pixels, int labels.

    Every rank computes the same split from the same seed, so no data is exchanged.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = d.data.astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, d.target, test_size=test_fraction, random_state=seed,
                                              stratify=d.target)
    mean, std = x_tr.mean(), x_tr.std() or 1.0
    return (x_tr - mean) / std, y_tr.astype(np.float32), (x_te - mean) / std, y_te.astype(np.float32)


def shard(n: int, rank: int, size: int, seed: int, epoch: int) -> np.ndarray:
    """This rank's indices of ``n`` samples for ``epoch``: one permutation everywhere, every size-th index.

    The permutation is padded by wrapping around to a multiple of ``size``,
    so every rank runs the same number of steps (as ``DistributedSampler``).
    """
    order = np.random.RandomState(seed + epoch).permutation(n)
    total = -(-n // size) * size
    order = np.concatenate([order, order[: total - n]])
    return order[rank:total:size]
