"""Giving an MLX module a different `__call__` without changing what it looks like.

The object becomes an instance of a subclass of its own class that has the same name, module
and qualified name and only overrides `__call__`. Hosts that call the model, check its type,
read its attributes or walk its parameters see the stock module. One subclass is made per
(class, purpose) and reused.
"""

from __future__ import annotations

from typing import Callable

# around(module, call, args, kwargs) -> result, where call(*args, **kwargs) is the stock call.
Around = Callable[[object, Callable, tuple, dict], object]


def wrap_call(obj, registry: dict[type, type], around_for: Callable[[type], Around]) -> None:
    """Make `obj` call `around` (built once per class by `around_for(its class)`) instead of its
    own `__call__`. `registry` is the purpose's class -> subclass table; wrapping twice is a no-op."""
    base = type(obj)
    if base in registry.values():
        return
    sub = registry.get(base)
    if sub is None:
        sub = registry[base] = _subclass(base, around_for(base))
    obj.__class__ = sub


def _subclass(base: type, around: Around) -> type:
    def __call__(self, *args, **kwargs):
        return around(self, super(sub, self).__call__, args, kwargs)

    sub = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})
    sub.__qualname__ = base.__qualname__
    return sub
