"""Trainable parameters the optimizer holds that the Watcher does not watch.

The run's layers are fixed when watching starts: the trainable parameters the optimizer holds then.
Training changes that set: a backbone frozen for the first epochs and unfrozen later (progressive
unfreezing) while the optimizer already held it, or parameters added with add_param_group. Their
gradients are still part of what the loop clips and steps with, so they count in grad/global_norm
(and its post-clip value); they have no per-layer values (no column of their own in the run's
per-layer vectors), and a `params_unwatched` event names them once per change.

Looked for once per backward pass, on the host: the optimizer's group count and the frozen held
parameters' requires_grad flags (cheap attribute reads). Their gradients are read on the device, as
the watched ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _quantities

MAX_NAMES_IN_EVENT = 50


class UnwatchedParameters:
    def __init__(
        self,
        model: Any,
        optimizer: Any,
        watched: list[Any],
        hook: Callable[[Any], None],
        handles: list[Any],
        enabled: bool = True,
    ) -> None:
        """enabled=False (sharded DTensor parameters, whose norms are read shard by shard): none are
        ever looked for."""
        self.enabled = enabled
        self.optimizer = optimizer
        self._watched = {id(p) for p in watched}
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._hook = hook  # the Watcher's per-parameter gradient hook: the end of backward, passes
        self.handles = handles  # the Watcher's: removed with its own
        self.params: list[Any] = []  # held, trainable now, not watched
        self._frozen: list[Any] = []  # held, frozen, not watched: they may be unfrozen
        self._groups = -1  # the first look takes what is held (no name: the Watcher watches them all)
        self._hooked: set[int] = set()

    def changed(self) -> list[str] | None:
        """The names of the parameters trainable and unwatched now, when that set changed since the
        last look (a group added, a held frozen parameter unfrozen or one frozen again); else None."""
        groups = self.optimizer.param_groups
        if not self.enabled or (
            len(groups) == self._groups
            and not any(p.requires_grad for p in self._frozen)
            and all(p.requires_grad for p in self.params)
        ):
            return None
        self._groups = len(groups)
        held = list({id(p): p for group in groups for p in group["params"]}.values())
        unwatched = [p for p in held if id(p) not in self._watched]
        self.params = [p for p in unwatched if p.requires_grad]
        self._frozen = [p for p in unwatched if not p.requires_grad]
        for param in self.params:
            if id(param) not in self._hooked:
                self._hooked.add(id(param))
                try:
                    self.handles.append(param.register_post_accumulate_grad_hook(self._hook))
                except (
                    AttributeError,
                    RuntimeError,
                ):  # a tensor subclass without it: counted in the norm only
                    pass
        return [self._names.get(id(p), f"unnamed{i}") for i, p in enumerate(self.params)]

    def squared_norm(self, like: Any, scale: Any = None) -> Any:
        """The sum of the squared L2 norms of their gradients now (÷ `scale`, a device scalar, when
        still scaled), a 0-dim float32 tensor on `like`'s device; None when they have none."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return None
        return _quantities.layer_norms(grads, like, divide_by=scale).square().sum()

    def event_data(self, names: list[str]) -> dict[str, Any]:
        return {
            "layers": names[:MAX_NAMES_IN_EVENT],
            "count": len(names),
            "hint": "trainable parameters the optimizer holds that were frozen (or not in it) when "
            "run.watch() was called: their gradients count in grad/global_norm, but they have no "
            "per-layer values (the run's layers are the trainable parameters the optimizer held when "
            "watching started)",
        }
