"""The one map from a precision's name (``--bf16``, ``--fp16``, default fp32) to its dtype."""

from __future__ import annotations

import torch

# The names the config uses (hybrid.config.sections: PrecisionConfig.params_dtype).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
