"""The table of structures a ``structure=`` option may name, and what each can do.

Every reader of a structure's capabilities (the options, the plan, ``rank_by``, the bounds, the
callbacks' checks) asks here, so a new structure is its class plus one :func:`register_structure`.

Example:
    >>> structure_class("KRON").__name__
    'KronStructure'
    >>> structures_with("per_tensor_prior")
    ('kron', 'ekfac')
"""
from __future__ import annotations

from typing import Dict, Tuple, Type

from ...structure_options import prior_elsewhere, registered_structures, structure_names
from ...validators import choice
from ..statistics import Structure

__all__ = [
    "CAPABILITIES",
    "register_structure",
    "structure_class",
    "structure_names",
    "structures_with",
    "unregister_structure",
]

# the yes/no capabilities a structure class declares (class attributes of Structure, documented there)
CAPABILITIES = ("hook_path", "per_tensor_prior", "multi_process", "training_statistics", "parametric_bound", "rank_by")

# the table sits below the prior and the options (lightning_marglik.structure_options), which read its names
_REGISTRY: Dict[str, Type[Structure]] = registered_structures


def register_structure(cls: Type[Structure]) -> Type[Structure]:
    """Make ``structure=cls.name`` select ``cls`` everywhere (usable as a class decorator).

    Args:
        cls: A :class:`..statistics.Structure` subclass with its own ``name`` and ``from_plan``.

    Returns:
        ``cls``.

    Raises:
        TypeError: If ``cls`` is not a ``Structure`` subclass.
        ValueError: If it declares no ``name`` of its own, a name that differs from another only in
            case, or a name another class holds (unregister that one first).
    """
    if not (isinstance(cls, type) and issubclass(cls, Structure)):
        raise TypeError(f"register_structure takes a Structure subclass, got {cls!r}.")
    name = cls.__dict__.get("name")  # its own: a subclass would otherwise inherit its parent's name
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"{cls.__name__} must declare its own `name = '...'` (the structure= value) to be registered.")
    taken = next((known for known in _REGISTRY if known.lower() == name.lower()), None)
    if taken is not None and _REGISTRY[taken] is not cls:
        raise ValueError(
            f"structure {name!r} is taken by {_REGISTRY[taken].__module__}.{_REGISTRY[taken].__qualname__}; "
            "choose another name or unregister_structure it first."
        )
    _REGISTRY[name] = cls
    return cls


def unregister_structure(name: str) -> Type[Structure]:
    """Remove a registered structure (e.g. a test's own); returns its class.

    Raises:
        ValueError: For a name that is not registered (with a "did you mean").
    """
    return _REGISTRY.pop(choice(name, structure_names(), "structure"))


def structure_class(name: str) -> Type[Structure]:
    """The class ``structure=name`` selects, matched case-insensitively.

    Raises:
        ValueError: Naming the registered structures (and the near miss, e.g. 'kfac' -> 'kron').
    """
    return _REGISTRY[choice(name, structure_names(), "structure", elsewhere=prior_elsewhere())]


def structures_with(capability: str) -> Tuple[str, ...]:
    """The registered structures whose class declares ``capability`` (one of :data:`CAPABILITIES`).

    Raises:
        ValueError: For an unknown capability.
    """
    capability = choice(capability, CAPABILITIES, "capability")
    return tuple(name for name, cls in _REGISTRY.items() if getattr(cls, capability))
