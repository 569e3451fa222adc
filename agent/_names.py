"""Layer names as the user wrote the model, not as its wrappers rename it.

torch.compile returns an OptimizedModule whose parameters are named `_orig_mod.<name>`; DDP and
DataParallel put `module.` in front; FSDP1 and activation checkpointing insert
`_fsdp_wrapped_module.` and `_checkpoint_wrapped_module.` at every wrapped level; a PEFT model
(LoRA, ...) puts `base_model.model.` in front of the user's model. The same layer
would carry a different name in a compiled run than in an eager one, and a name nobody typed on every
chart. user_layer_names() drops those components (`module.` only at the root of a DDP/DataParallel
model: a user's own submodule may be called `module`), keeping a name as it was when dropping would
make two layers alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["WRAPPER_COMPONENTS", "user_layer_names"]

# Dotted-name components that only wrappers insert, wherever they occur.
WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
_ROOT_WRAPPERS = frozenset({"DistributedDataParallel", "DataParallel"})  # prefix `module.`
_PEFT_PREFIX = ("base_model", "model")  # PeftModel -> its tuner (LoraModel...) -> the user's model


def _is_peft_model(model: Any) -> bool:
    return any(cls.__name__ == "PeftModel" for cls in type(model).__mro__)


def _root_wrappers(model: Any) -> tuple[int, bool]:
    """How many leading `module.` components the model's outer wrappers add (DDP around a compiled
    model around DDP...: each DDP or DataParallel adds one, at its own depth), and whether a PEFT
    model is inside them (its `base_model.model.` follows)."""
    depth, current = 0, model
    for _ in range(8):  # wrappers nest a few levels at most
        kind = type(current).__name__
        if kind in _ROOT_WRAPPERS:
            depth += 1
            current = getattr(current, "module", None)
        elif kind == "OptimizedModule":
            current = getattr(current, "_orig_mod", None)
        else:
            break
    return depth, _is_peft_model(current)


def user_layer_names(model: Any, names: Sequence[str]) -> list[str]:
    """`names` (from model.named_parameters()) without wrapper components, in the same order."""
    ddp_levels, peft = _root_wrappers(model)
    cleaned = []
    for name in names:
        parts = name.split(".")
        kept: list[str] = []
        wrappers_left = ddp_levels
        for part in parts[:-1]:  # the last component is the parameter itself ("weight")
            if part in WRAPPER_COMPONENTS:
                continue
            if part == "module" and wrappers_left and not kept:
                wrappers_left -= 1
                continue
            kept.append(part)
        if peft and tuple(kept[:2]) == _PEFT_PREFIX and len(kept) > 2:
            del kept[:2]
        cleaned.append(".".join([*kept, parts[-1]]) if parts else name)
    if len(set(cleaned)) != len(cleaned):  # dropping made two layers alike: keep what torch says
        taken: dict[str, int] = {}
        for short in cleaned:
            taken[short] = taken.get(short, 0) + 1
        cleaned = [short if taken[short] == 1 else full for short, full in zip(cleaned, names, strict=True)]
    return cleaned
