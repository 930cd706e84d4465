"""torch.load(weights_only=True), torch's default and Lightning's, reads mixedpolicy's policies.

A policy (or one of its dtypes, a string that also equals the dtype objects) saved in a
checkpoint, in a LightningModule's hyperparameters for instance, is rebuilt from its fields;
the weights-only unpickler refuses every class it was not told of, so the checkpoint would load
only with ``weights_only=False``. Loaded when torch is imported (the registry's ``on_import``).
"""

from __future__ import annotations

import torch

from mixedpolicy._dtypes import DType
from mixedpolicy.float8 import Float8Recipe
from mixedpolicy.policy import Policy

torch.serialization.add_safe_globals([DType, Policy, Float8Recipe])
