"""Facts about the Flower anchor's digits work (`participant.tasks.flower_digits`) that must be importable without
torch (the demo, the benchmark)."""

from __future__ import annotations

from participant.tasks import digits_meta

TASK = "participant.tasks.flower_digits:task"
TOTAL_SIZE = 1797  # scikit-learn's bundled digits
TEST_SIZE = 450  # train_test_split(test_size=0.25, random_state=0, stratify=y)
TRAIN_SIZE = TOTAL_SIZE - TEST_SIZE  # 1347
SPLIT_STATE = 0  # train_test_split's random_state
SHARD_SEED = 0  # np.random.default_rng(0).permutation(1347), then np.array_split into the shards
SHARDS = 4  # the anchor's participants: shard i is participant i's own data
ROUNDS = 15
LOCAL_EPOCHS = 1
BATCH_SIZE = 32
LEARNING_RATE = 0.05
MODEL_SCHEMA = digits_meta.MODEL_SCHEMA  # the digits MLP, 64 hidden units: the run's initial_model_schema
MOMENTUM = 0.9
FLOWER_ACCURACY = 0.9289  # Flower's test accuracy after the 15 rounds (and the recipe's, run directly in torch)
# the recipe's test accuracy after each round, to 4 decimals, run directly in torch (tests/unit/test_flower_task.py
# checks that the recipe gives these and that the task and the coordinator's FedAvg replay them)
RECIPE_ACCURACIES = (0.6289, 0.7667, 0.8089, 0.8222, 0.8756, 0.8800, 0.9089, 0.9178, 0.9244, 0.9267, 0.9200, 0.9267,
                     0.9267, 0.9378, 0.9289)
