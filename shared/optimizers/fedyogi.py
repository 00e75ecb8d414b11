"""FedYogi (Reddi et al. 2021): FedAdam with Yogi's additive second moment.

    v = v - (1 - b2) g^2 sign(v - g^2)      m and x' as FedAdam
"""

from __future__ import annotations

import numpy as np

from shared.optimizers.fedadam import FedAdam


def yogi_second_moment(v: np.ndarray, g2: np.ndarray, beta2: float) -> None:
    """v = v - (1 - beta2) g^2 sign(v - g^2), in place."""
    v -= np.float32(1 - beta2) * g2 * np.sign(v - g2)


class FedYogi(FedAdam):
    name = "fedyogi"

    @staticmethod
    def second_moment(v: np.ndarray, g2: np.ndarray, beta2: float) -> None:
        yogi_second_moment(v, g2, beta2)
