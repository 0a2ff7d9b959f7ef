"""What every gem_kernels module does for torch.fx and TorchScript.

torch.fx / ``torchrec.fx.symbolic_trace``: the modules check data (id ranges, mask shapes, KJT keys)
in Python, which a Proxy cannot answer. Under tracing their forward hands the whole call to
``traced_call``, a ``torch.fx.wrap``-ed leaf: the graph gets one ``call_function`` node that calls
the module itself at run time, so the checks run on real tensors then. The module reaches the
graph as a ``get_attr`` of its path (for the traced root itself: of an attribute the tracer adds).

TorchScript is deprecated in PyTorch and these modules' Python checks and custom ops are not
scriptable: ``torch.jit.script`` stops at ``__prepare_scriptable__`` with a message naming
``torch.export`` (and ``torch.compile``, ``torch.fx``), which do work.
"""

from __future__ import annotations

import torch
import torch.fx

_ROOT_ATTR = "_gem_kernels_traced_root"


class _ModuleArg:
    """A module as an argument of a graph node: ``get_attr`` of its path under the tracer's root."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __fx_create_arg__(self, tracer):
        for name, m in tracer.root.named_modules():
            if m is self.module and name:
                return tracer.create_node("get_attr", name, (), {})
        if self.module is tracer.root:
            # A plain attribute, not a registered submodule (that would make the root its own child);
            # the GraphModule then holds the module as its submodule of this name.
            tracer.root.__dict__[_ROOT_ATTR] = self.module
            return tracer.create_node("get_attr", _ROOT_ATTR, (), {})
        raise NameError(f"{type(self.module).__name__} is not a submodule of the traced module")


def traced_call(module, *args, **kwargs):
    """Call ``module`` (at run time it is the module, during tracing a ``_ModuleArg``)."""
    return module(*args, **kwargs)


torch.fx.wrap("traced_call")


def is_proxy(*values) -> bool:
    """Whether a torch.fx tracer is feeding this call."""
    return any(isinstance(v, torch.fx.Proxy) for v in values)


def trace_call(module, *args, **kwargs):
    """The graph node of ``module(*args, **kwargs)`` under torch.fx tracing."""
    return traced_call(_ModuleArg(module), *args, **kwargs)


class NotScriptable:
    """Mixin: ``torch.jit.script`` raises a clear error naming the ways that work."""

    def __prepare_scriptable__(self):
        raise TypeError(
            f"{type(self).__module__}.{type(self).__qualname__} does not support TorchScript (torch.jit.script "
            "is deprecated in PyTorch; these modules run custom ops behind Python checks). Use torch.export.export("
            "model, args) for an exported graph, torch.compile for speed, or torch.fx / torchrec.fx.symbolic_trace "
            "for a traced GraphModule.")
