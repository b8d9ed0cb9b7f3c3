"""A user's own ``torch.nn.Module`` as a :class:`~p2pfl.learning.models.SplitModel`.

``model.name: "package.module:factory"`` names a factory called as
``factory(num_classes=C, input_shape=(...), **model.kwargs)`` that returns any
``nn.Module`` mapping a batch ``(B, *input_shape)`` to logits ``(B, C)``.
``model.personal`` lists the parameter-name prefixes that form the personal part ``h``
(default: the last ``nn.Linear`` in module order, none when the model has no ``nn.Linear``);
every other parameter and buffer is ``g``. Either part may be empty: ``model.personal: []``
keeps nothing personal (``h`` is the identity), and a personal part that covers every
parameter (a model of one ``nn.Linear``, by default) leaves ``g`` the identity. A method
whose maths needs both parts says so when it is checked
(:attr:`~p2pfl.algorithms.base.Method.needs_parts`).

Contract (the :class:`SplitModel` one every method relies on):

* ``state_dict()`` names are ``g.<user name>`` and ``h.<user name>``, where ``<user name>``
  is the name in the user's own ``state_dict``: the parts are chosen by prefix alone, and
  :meth:`UserSplitModel.export_module` gives back the user's module with the user's names.
* The user's module holds the tensors: ``g`` and ``h`` are *views* of it, containers that
  register the user's own submodules and parameters (no copies), so loading a state into
  this model loads it into the user's module, and an optimizer over ``parameters()`` trains
  it. ``forward`` is the user's ``forward``.
* ``features(x)`` is ``g(x)`` in the sense of the methods (UA-PDFL's auxiliary
  representation, pFedC's shared representation): the input of the first personal module
  the forward pass reaches, flattened to ``(B, F)``; a forward pre-hook captures it. With
  ``g`` empty it is the input ``x`` flattened; with ``h`` empty, the output. A personal
  part inside one module (``model.personal: [linear.bias]``: shared weights, a personal
  intercept) has no module of its own to reach: its features are the input flattened too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from p2pfl.errors import P2PFLError
from p2pfl.learning.split_model import SplitModel
from p2pfl.learning.user_code import describe


class ModelSplitError(P2PFLError, ValueError):
    """``model.personal`` names what the model does not hold, the forward pass never
    reaches ``h``, or the model's output is not ``(B, C)`` logits.
    ``field``: the config field to fix."""

    def __init__(self, message: str, field: str = "model.personal"):
        self.field = field
        super().__init__(message)


def matches(name: str, prefix: str) -> bool:
    """Whether parameter ``name`` falls under ``prefix``: the name itself, a dotted path
    below it (``fc`` covers ``fc.weight``, not ``fc2.weight``), or any name starting with a
    prefix that ends with a dot."""
    if prefix.endswith("."):
        return name.startswith(prefix)
    return name == prefix or name.startswith(prefix + ".")


def default_personal(net: nn.Module) -> list[str]:
    """The last ``nn.Linear`` of ``net`` in module order: its name, or, when ``net`` is
    itself an ``nn.Linear``, its parameters' names; ``[]`` (nothing personal) when it has
    none."""
    linears = [n for n, m in net.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        return []
    if linears[-1]:
        return linears[-1:]
    return [n for n, _ in net.named_parameters()]


def _tensor_names(net: nn.Module) -> list[str]:
    names = [n for n, _ in net.named_parameters(remove_duplicate=False)]
    return names + [n for n, _ in net.named_buffers(remove_duplicate=False)]


def check_split(net: nn.Module, personal: list[str]) -> None:
    """``ModelSplitError`` unless the model has a trainable parameter, each prefix matches
    a parameter or buffer of ``net`` and the prefixes, when there are any, cover a
    trainable parameter. Either part may be left empty (the module docstring)."""
    names = _tensor_names(net)
    params = [n for n, _ in net.named_parameters()]
    if not params:
        raise ModelSplitError("the model has no parameter to train", field="model.name")
    for p in personal:
        if not any(matches(n, p) for n in names):
            shown = ", ".join(sorted({n.rsplit(".", 1)[0] for n in names})[:8])
            raise ModelSplitError(
                f"prefix {p!r} matches no parameter of the model (its modules: {shown})"
            )
    if personal and not any(matches(n, p) for n in params for p in personal):
        raise ModelSplitError(f"prefixes {personal} cover no trainable parameter")


def _part_views(net: nn.Module, is_personal: Callable[[str], bool]) -> tuple[nn.Module, nn.Module]:
    """``(g, h)``: containers mirroring ``net``'s module tree that register ``net``'s own
    submodules, parameters and buffers under the same relative names, each in the part its
    names fall in. A submodule whose tensors are all in one part is registered whole; one
    that straddles both parts gets a container in each, recursively."""
    g, h = nn.Module(), nn.Module()

    def part_of(prefix: str, module: nn.Module) -> str | None:
        names = [prefix + n for n, _ in module.named_parameters(remove_duplicate=False)]
        names += [prefix + n for n, _ in module.named_buffers(remove_duplicate=False)]
        parts = {is_personal(n) for n in names}
        if not parts:
            return None  # nothing to hold (activations, pooling): train()/eval() reach it
        return "mixed" if len(parts) == 2 else ("h" if parts.pop() else "g")

    def walk(module: nn.Module, prefix: str, views: dict[str, nn.Module]) -> None:
        for pname, param in module._parameters.items():
            if param is not None:
                target = views["h" if is_personal(prefix + pname) else "g"]
                target.register_parameter(pname, param)
        for bname, buf in module._buffers.items():
            if buf is not None:
                target = views["h" if is_personal(prefix + bname) else "g"]
                persistent = bname not in module._non_persistent_buffers_set
                target.register_buffer(bname, buf, persistent=persistent)
        for cname, child in module._modules.items():
            if child is None:
                continue
            part = part_of(prefix + cname + ".", child)
            if part in ("g", "h"):
                views[part].add_module(cname, child)
            elif part == "mixed":
                sub = {"g": nn.Module(), "h": nn.Module()}
                walk(child, prefix + cname + ".", sub)
                views["g"].add_module(cname, sub["g"])
                views["h"].add_module(cname, sub["h"])

    walk(net, "", {"g": g, "h": h})
    return g, h


class _Reached(Exception):
    """Raised by the feature hook to stop a forward pass once ``h``'s input is known."""


class UserSplitModel(SplitModel):
    """A user's module split by parameter-name prefixes (module docstring)."""

    def __init__(
        self,
        net: nn.Module,
        personal: list[str],
        *,
        name: str,
        num_classes: int,
        input_shape: tuple[int, ...],
    ):
        check_split(net, personal)
        self.personal = list(personal)
        g, h = _part_views(net, self.is_personal)
        super().__init__(g, h, name=name, num_classes=num_classes, input_shape=input_shape)
        object.__setattr__(self, "net", net)  # not a registered child: g and h hold its tensors
        self._feature_hooks: list[Any] = []
        self._seen: list[torch.Tensor] = []
        self._active = False  # the hooks capture only inside _run
        self._stop = False
        self._install_hooks()

    # -- the split ---------------------------------------------------------------------
    def is_personal(self, name: str) -> bool:
        """Whether the user's parameter or buffer ``name`` is in ``h``."""
        return any(matches(name, p) for p in self.personal)

    def _personal_roots(self) -> list[nn.Module]:
        """The topmost submodules of the user's module whose tensors are all in ``h``."""
        roots: list[nn.Module] = []
        taken: list[str] = []
        for mname, mod in self.net.named_modules():
            if not mname or any(mname.startswith(t + ".") for t in taken):
                continue
            names = [f"{mname}.{n}" for n, _ in mod.named_parameters(remove_duplicate=False)]
            if names and all(self.is_personal(n) for n in names):
                roots.append(mod)
                taken.append(mname)
        return roots

    def _install_hooks(self) -> None:
        for handle in self._feature_hooks:
            handle.remove()

        def capture(_mod: nn.Module, args: tuple[Any, ...]) -> None:
            if not self._active or self._seen or not args:
                return
            if not isinstance(args[0], torch.Tensor):
                return
            self._seen.append(args[0])
            if self._stop:
                raise _Reached

        self._feature_hooks = [m.register_forward_pre_hook(capture) for m in self._personal_roots()]

    # -- forward -----------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _run(self, x: torch.Tensor, stop: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.personal:  # h is the identity: the features are the output
            logits = self.net(x)
            return logits.flatten(1), logits
        if not self._feature_hooks:  # g the identity, or h inside one module (its bias)
            return x.flatten(1), (None if stop else self.net(x))
        self._seen, self._stop, self._active = [], stop, True
        logits = None
        try:
            logits = self.net(x)
        except _Reached:
            pass
        finally:
            seen, self._seen, self._stop, self._active = self._seen, [], False, False
        if not seen:
            raise ModelSplitError(
                f"the forward pass never reached the personal part h {self.personal} with a "
                "tensor input, so the methods cannot see the features g(x)"
            )
        return seen[0].flatten(1), logits

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """``g(x)``: the input of the first personal module reached, flattened ``(B, F)``."""
        return self._run(x, stop=True)[0]

    def features_and_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats, logits = self._run(x, stop=False)
        assert logits is not None
        return feats, logits

    # -- the user's module stays the one that holds the tensors ----------------------------
    def train(self, mode: bool = True) -> UserSplitModel:
        super().train(mode)
        self.net.train(mode)  # modules without tensors (dropout) are reached through it
        return self

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> UserSplitModel:
        # moved or cast through the user's module, then the views re-registered: a buffer
        # replaced by the move must be the one the user's forward reads
        self.net._apply(fn, recurse)
        self.g, self.h = _part_views(self.net, self.is_personal)
        return self

    def replace_module(self, name: str, new: nn.Module) -> None:
        """Put ``new`` at ``name`` (``g.<user path>`` or ``h.<user path>``) in the user's
        module, and re-register the views."""
        part, _, path = name.partition(".")
        if part not in ("g", "h") or not path:
            raise ValueError(f"replace_module: {name!r} is not 'g.<path>' or 'h.<path>'")
        parent_name, _, child = path.rpartition(".")
        parent = self.net.get_submodule(parent_name) if parent_name else self.net
        setattr(parent, child, new)
        self.g, self.h = _part_views(self.net, self.is_personal)
        self._install_hooks()

    def export_module(self) -> nn.Module:
        return self.net

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, personal={self.personal}"


def build_user_model(
    factory: Callable[..., Any],
    path: str,
    num_classes: int,
    input_shape: tuple[int, ...],
    personal: list[str] | None,
    kwargs: dict[str, Any] | None = None,
) -> UserSplitModel:
    """``factory(num_classes=..., input_shape=..., **kwargs)`` split by ``personal``
    (default: its last ``nn.Linear``). ``TypeError`` if the factory returns no
    ``nn.Module``; ``ModelSplitError`` for a split that does not work; the factory's own
    exceptions propagate (the caller names the factory)."""
    net = factory(num_classes=num_classes, input_shape=tuple(input_shape), **(kwargs or {}))
    if not isinstance(net, nn.Module):
        raise TypeError(f"returned {type(net).__name__}, not a torch.nn.Module")
    prefixes = list(personal) if personal is not None else default_personal(net)
    model = UserSplitModel(
        net, prefixes, name=path, num_classes=num_classes, input_shape=tuple(input_shape)
    )
    with torch.no_grad():
        was = model.training
        model.eval()
        batch = (2, *input_shape)
        try:
            feats, logits = model.features_and_logits(torch.zeros(batch))
        except ModelSplitError:
            raise
        except Exception as exc:  # the user's forward cannot take the declared shape
            raise ModelSplitError(
                f"forward fails on a batch of shape {list(batch)} (input_shape "
                f"{list(input_shape)}): {describe(exc)}",
                field="model.name",
            ) from None
        finally:
            model.train(was)
    if tuple(logits.shape) != (2, num_classes):
        raise ModelSplitError(
            f"the model outputs {tuple(logits.shape)} for a batch of 2; the loss takes "
            f"(2, {num_classes})",
            field="training.loss",
        )
    model.feature_dim = int(math.prod(feats.shape[1:]))
    return model
