"""Facts about the built-in digits task that must be importable without torch (run configs, the demo)."""

from __future__ import annotations

TASK = "participant.tasks.digits:task"
TOTAL_SIZE = 1797  # scikit-learn's bundled digits: 1797 images of 8 x 8 pixels, 10 classes
TEST_SIZE = 360
TRAIN_SIZE = TOTAL_SIZE - TEST_SIZE  # 1437
SPLIT_SEED = 20240601  # fixes the train/test split on every host
