"""When a patched module runs its fused forward, and when HF's own forward instead.

patch_model swaps `guarded(fused)` into every module it patches. Per call it takes the fused forward only where
that computes what HF's forward computes and nothing outside can tell them apart:

- no gradient is recorded through the module: grad mode is off, or the module is in eval mode and neither its
  parameters nor its input tensors require grad. The fused ops have no backward formulas. HF's forward runs on the
  same parameters (those of fused projections are views of the fused buffers, so nothing is copied) and records
  HF's graph, with gradient checkpointing where it is on (transformers wraps the layer class's `forward`, which
  is the forward that runs);
- no dropout is due (training mode with a dropout probability: HF's forward applies it);
- no user hook sits on a submodule the fused forward does not call (a hook on q_proj, on a layer's norm); the
  report notes the boundary the first time;
- the plan still reads the module's weights (Watch). A sub-module, parameter or buffer replaced (load_state_dict
  with assign=True, an adapter in place of q_proj), moved or cast (to(), half(), cuda()) or re-pointed
  (`p.data = ...`) since the plan was built makes the module rebuild its plan from its current weights first.
  Where they can no longer be planned (an adapter in place of q_proj), HF's forward runs until they can.

HF's forward is the one patch_model replaced. A ResidualStream input is summed first, so it sees a plain tensor.
In-place updates (an optimizer step, load_state_dict without assign) need nothing: the plans read the parameters'
own memory.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from itertools import chain
from operator import is_

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from ..parallel import shard
from .stream import ResidualStream, materialize

# transformers installs this forward hook on every decoder layer and attention module the first time a caller asks
# for hidden states or attentions; it records only while HF collects them (stream.recording_hidden_states), and
# reads what HF gives it either way.
CAPTURE_HOOK = "install_output_capuring_hook.<locals>.output_capturing_hook"


class Unplannable(Exception):
    """The module's current weights can't be planned (the reason is the message); HF's forward serves it."""


def user_hooks(module: nn.Module) -> bool:
    """Whether a forward hook or pre-hook other than transformers' output capture sits on `module` (or on every
    module: the global hooks)."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        if hooks and any(getattr(h, "__qualname__", "") != CAPTURE_HOOK for h in hooks.values()):
            return True
    return False


def needs_grad(module: nn.Module, args, kwargs) -> bool:
    """Whether a gradient would be recorded through `module` for these inputs (grad mode is on)."""
    if module.training or any(p.requires_grad for p in module.parameters()):
        return True
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, tuple) and any(isinstance(t, torch.Tensor) and t.requires_grad for t in value):
            return True  # a ResidualStream, position_embeddings
    return False


class Watch:
    """Where the weights a plan was built from are: the patched module's sub-modules (`owners[0]`'s children) and
    the parameters and buffers of `owners` (the module and the children whose weights the plan reads), by identity,
    and the memory (data_ptr) of those tensors.

    `changed()` shows a replaced sub-module (an adapter) or tensor (load_state_dict with assign=True), a cast or
    device move, a `.data` assignment, and an entry added or removed. A plan holds the tensors it read, so their
    memory can't be reused by others while it holds them.
    """

    def __init__(self, owners: list[nn.Module]):
        self.dicts = [owners[0]._modules] + [d for m in owners for d in (m._parameters, m._buffers) if d]
        self.seen = list(chain.from_iterable(map(dict.values, self.dicts)))
        # (a DTensor's own data_ptr is 0: its local shard holds the memory)
        self.tensors = [shard(t) for t in self.seen if isinstance(t, torch.Tensor)]
        self.ptrs = list(map(torch.Tensor.data_ptr, self.tensors))

    def changed(self) -> bool:
        if torch.compiler.is_compiling():  # (data_ptr does not trace; a compiled graph guards on what it read)
            return False
        now = list(chain.from_iterable(map(dict.values, self.dicts)))  # (C-level loops: this runs every call)
        if len(now) != len(self.seen) or not all(map(is_, now, self.seen)):
            return True
        return list(map(torch.Tensor.data_ptr, self.tensors)) != self.ptrs


class Guard:
    """What a patched module checks before its fused forward (see the module docstring). `planner` builds its plans
    (plans.Planner); `kind` is "layer", "attention", "mlp" or "norm"."""

    def __init__(self, name: str, kind: str, original: Callable | None, planner, next_module: nn.Module | None = None):
        self.name, self.kind = name, kind
        self.original = original  # the forward patch_model replaced on the instance; None: the class's forward
        self.planner = planner
        self.next_module = next_module  # a layer's: the module after it (the next layer, or the final norm)
        self.dropout = kind != "norm" and planner.dropout  # in training mode HF's forward applies a dropout
        self.reason: str | None = None  # why HF's forward serves the module until its weights change again
        self.hook_dicts: list = []  # the hooks of the children the fused forward does not call
        self.watch: Watch | None = None

    def __reduce_ex__(self, protocol):
        # Met first by pickle in every patched module (its __dict__ holds the guard before the plan): the fused
        # forwards and plans are functions of this process, which a pickle can't hold (torch.save(model)).
        raise TypeError(
            f"a patched model can't be pickled whole ({self.name} is patched): save its weights (save_pretrained, or "
            "torch.save(model.state_dict())) and call patch_model on the model loaded from them, or call "
            "unpatch_model(model) before pickling it"
        )

    def __deepcopy__(self, memo):
        # copy.deepcopy of a patched model (a working patched copy, whose plans rebuild from the copy's weights)
        # copies the guard as a plain object would be; only pickling is refused.
        new = Guard.__new__(Guard)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def note(self, text: str) -> None:
        self.planner.note(text)

    def rebuild(self, module: nn.Module) -> bool:
        """Plans the module from its current weights (or records why it can't); True when the plan is usable."""
        try:
            # (under inference_mode too, the fused buffers must be normal tensors: the parameters become their views)
            with torch.inference_mode(False), torch.no_grad():
                module._patcher = self.planner.plan(self.kind, module, self.next_module)
            self.reason = None
        except Unplannable as e:
            module.__dict__.pop("_patcher", None)
            if self.reason != str(e):
                self.note(f"{self.name}: HF's forward runs ({e})")
            self.reason = str(e)
        self.planner.placed(self.name, module, self.reason)
        if self.kind == "layer":
            # The layer's fused forward does not call its norms (their weights are in the layer's plan): their own
            # plans and the report's placements follow the layer's here.
            for child in self.planner.skipped(self.kind, module):
                guard = getattr(child, "_patcher_guard", None)
                if guard is not None and (guard.watch is None or guard.watch.changed()):
                    guard.rebuild(child)
        self.watch = Watch(self.planner.owners(self.kind, module))
        self.hook_dicts = [
            d for c in self.planner.skipped(self.kind, module) for d in (c._forward_pre_hooks, c._forward_hooks)
        ]
        return self.reason is None

    def check(self, module: nn.Module) -> bool:
        """Rebuilds the plan where the weights changed; True when the fused forward can run on them."""
        if self.watch.changed():
            return self.rebuild_changed(module)
        return self.reason is None

    def rebuild_changed(self, module: nn.Module) -> bool:
        self.note(
            "weights changed after patching (replaced, moved, cast or re-pointed): the patched modules rebuilt "
            "their plans from the current weights"
        )
        return self.rebuild(module)

    def fused(self, module: nn.Module, args, kwargs) -> bool:
        """Whether this call may take the fused forward (the first test is all the no_grad path pays)."""
        if (torch.is_grad_enabled() or module.training) and self.needs_hf(module, args, kwargs):
            return False
        if (any(self.hook_dicts) or torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks) and (
            self.hooked_child(module)
        ):
            return False
        if self.watch.changed():  # (check(), inline: this runs every call)
            return self.rebuild_changed(module)
        return self.reason is None

    def hooked_child(self, module: nn.Module) -> bool:
        hooked = [c for c in self.planner.skipped(self.kind, module) if user_hooks(c)]
        for child in hooked:
            self.note(
                f"{self.name}: a hook on its {_child_name(module, child)!r}: HF's forward runs there, so the fusion "
                "across it is skipped"
            )
        return bool(hooked)

    def needs_hf(self, module: nn.Module, args, kwargs) -> bool:
        """For autograd, dropout or gradient checkpointing (grad mode on, or training mode). transformers before 5.24
        checkpoints in the layer's __call__, around this forward, whose first pass runs without grad mode (reentrant
        checkpointing): the training flag says that HF's forward must run there too."""
        if module.training and (self.dropout or getattr(module, "gradient_checkpointing", False)):
            return True
        return torch.is_grad_enabled() and needs_grad(module, args, kwargs)

    def hf_forward(self, module: nn.Module, args, kwargs):
        """The forward patch_model replaced, on a plain tensor."""
        if args and isinstance(args[0], ResidualStream):
            args = (materialize(*args[0]), *args[1:])
        if isinstance(kwargs.get("hidden_states"), ResidualStream):
            kwargs["hidden_states"] = materialize(*kwargs["hidden_states"])
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(module).forward(module, *args, **kwargs)


def weights_signature(model: nn.Module) -> list:
    """Every parameter and buffer of `model`, module by module: identity, memory, dtype and in-place version (freed
    memory may be reused, by a tensor of another dtype too)."""
    return [
        (id(t), local.data_ptr(), t.dtype, _version(local))
        for m in model.modules()
        for d in (m._parameters, m._buffers)
        for t in d.values()
        if t is not None
        for local in (shard(t),)  # (a DTensor's own data_ptr is 0: its local shard's memory is what moves)
    ]


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: it can't be updated in place outside inference mode
        return -1


def _child_name(parent: nn.Module, child: nn.Module) -> str:
    return next((n for n, c in parent.named_children() if c is child), "?")


def guarded(fused: Callable) -> Callable:
    """The forward patch_model swaps in: `fused` where the module's Guard allows it, HF's forward otherwise."""

    @functools.wraps(fused)
    def forward(self, *args, **kwargs):
        guard: Guard = self._patcher_guard
        if guard.fused(self, args, kwargs):
            return fused(self, *args, **kwargs)
        return guard.hf_forward(self, args, kwargs)

    return forward
