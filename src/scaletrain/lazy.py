"""Package roots that re-export names of torch-using modules load them on first use (PEP 562), so that importing a
torch-free module of the package (its validate() rules, which the package root `scaletrain` registers whenever
anything of scaletrain is imported) imports neither torch nor the rest of the package."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any


def exports(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `name` is imported from `package.<names[name]>` on first use."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(f"{package}.{names[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def keep_functions(package: str, names: dict[str, str]) -> None:
    """For re-exported functions that share their name with a submodule of `package` (scaletrain.parallel's `zero`,
    the pipeline's `simulate`): loading a submodule binds it on its package, which would hide the function. The
    package's attribute stays the function (as it was when the root imported it eagerly); the submodule stays in
    sys.modules, where imports find it."""

    def entry(name: str, module: str) -> property:
        def get(_package: types.ModuleType) -> Any:
            return getattr(importlib.import_module(f"{package}.{module}"), name)

        return property(get, lambda _package, _value: None)

    root = sys.modules[package]
    root.__class__ = type(type(root).__name__, (types.ModuleType,),
                          {name: entry(name, module) for name, module in names.items()})
