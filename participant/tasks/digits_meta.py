"""Facts about the built-in digits task that must be importable without torch (run configs, the demo)."""

from __future__ import annotations

from shared.digest import digest
from shared.wire import TensorSpec, encode_header

TASK = "participant.tasks.digits:task"
TOTAL_SIZE = 1797  # scikit-learn's bundled digits: 1797 images of 8 x 8 pixels, 10 classes
TEST_SIZE = 360
TRAIN_SIZE = TOTAL_SIZE - TEST_SIZE  # 1437
SPLIT_SEED = 20240601  # fixes the train/test split on every host
HIDDEN = 64  # the MLP's hidden width: 64 -> HIDDEN -> 10
# The digits tasks (and the Flower anchor's, which trains as they do) step with participant.sgd, not torch.optim
# (whose first optimizer imports torch._dynamo): what the task says (`torch_optimizers`) and the demo's zygote reads
TORCH_OPTIMIZERS = False


def mlp_tensors(hidden: int = HIDDEN, dtype: str = "F32") -> dict[str, TensorSpec]:
    """The tensors of the digits MLP (`nn.Sequential(Linear(64, hidden), ReLU(), Linear(hidden, 10))`), as its
    state dict names them."""
    return {"0.weight": TensorSpec(dtype, (hidden, 64)), "0.bias": TensorSpec(dtype, (hidden,)),
            "2.weight": TensorSpec(dtype, (10, hidden)), "2.bias": TensorSpec(dtype, (10,))}


# The run's `initial_model_schema` for this task: ingest refuses an initial-model offer with other tensors
MODEL_SCHEMA = digest(encode_header(mlp_tensors()))
