"""``deepspeed.runtime.activation_checkpointing``: its ``checkpointing`` module.

DeepSpeed's ``deepspeed.checkpointing`` is its
``deepspeed.runtime.activation_checkpointing.checkpointing``, and Megatron-style scripts
import it by either name. Here both are :mod:`hybrid.deepspeed.checkpointing`, one
module object (so ``configure`` is kept once): ``from
deepspeed.runtime.activation_checkpointing import checkpointing`` and ``import
deepspeed.runtime.activation_checkpointing.checkpointing`` give it. Nothing else of the
package is served; a name asked for is refused with what to use instead.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from hybrid.deepspeed import checkpointing
from hybrid.deepspeed.missing import refuse

__all__ = ["checkpointing"]

# the dotted name is the same module object ([Note: the alias is the same module object]
# in hybrid/deepspeed/alias.py, the same reason)
sys.modules[f"{__name__}.checkpointing"] = checkpointing


def __getattr__(name: str) -> NoReturn:
    refuse("runtime.activation_checkpointing", name,
           "it holds checkpointing (deepspeed.checkpointing) only")
