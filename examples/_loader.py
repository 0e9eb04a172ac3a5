"""The examples' resumable data loader (NumPy only; not part of the ftkit package)."""
from __future__ import annotations

import numpy as np


class Loader:
    """Resumable sampler over a fixed synthetic regression set; state = epoch + position."""

    def __init__(self, seed: int, n: int = 2048, dim: int = 16, batch: int = 32) -> None:
        g = np.random.default_rng(seed)
        self.x = g.standard_normal((n, dim)).astype(np.float32)
        w = g.standard_normal((dim, 1)).astype(np.float32)
        self.y = np.tanh(self.x @ w) + 0.05 * g.standard_normal((n, 1)).astype(np.float32)
        self.seed, self.batch = seed, batch
        self.epoch, self.pos = 0, 0

    def next(self, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's part of the next global batch."""
        if self.pos + self.batch > len(self.x):
            self.epoch, self.pos = self.epoch + 1, 0
        order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.x))
        idx = order[self.pos:self.pos + self.batch][rank::world]
        self.pos += self.batch
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])
