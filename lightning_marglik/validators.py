"""Checks of user-given option values, shared by every entry point (callbacks, engine, selection, CLI).

Each check returns the value in its canonical form or raises ``ValueError`` with a one-line
message that names the option, the bad value and what is accepted, as Lightning's own callbacks
do. Option *names* (``structure``, ``approx``, ...) are spelled in the messages exactly as the
user passes them.

Example:
    >>> choice("KRON", ("full", "kron", "ekfac", "diag"), "structure")
    'kron'
    >>> integer(5, "frequency", minimum=1)
    5
"""
from __future__ import annotations

import difflib
import math
import numbers
from typing import Any, Mapping, Optional, Sequence, Tuple

from torch import Tensor

__all__ = ["SYNONYMS", "choice", "flag", "integer", "keywords", "number", "optional", "suggestion"]

# Names users bring from other libraries (laplace-torch, BackPACK, the literature) for the values
# we spell otherwise: a miss on one of them is answered with ours.
SYNONYMS: Mapping[str, str] = {
    "kfac": "kron",
    "kron-fac": "kron",
    "kronecker": "kron",
    "diagonal": "diag",
    "dense": "full",
    "gauss-newton": "ggn",
    "gn": "ggn",
    "fisher": "ggn",
    "empirical-fisher": "ef",
    "empirical_fisher": "ef",
    "backpack-for-pytorch": "backpack",
    "per-tensor": "layerwise",
    "per-layer": "layerwise",
    "isotropic": "scalar",
}


def suggestion(value: Any, choices: Sequence[str]) -> str:
    """``" (did you mean 'kron'?)"`` for a near miss of ``choices``, else ``""``."""
    if not isinstance(value, str):
        return ""
    key = value.strip().lower()
    near = SYNONYMS.get(key)
    if near not in choices:
        close = difflib.get_close_matches(key, [c.lower() for c in choices], n=1, cutoff=0.6)
        near = next((c for c in choices if close and c.lower() == close[0]), None)
    return f" (did you mean {near!r}?)" if near is not None else ""


def choice(
    value: Any, choices: Sequence[str], name: str, what: str = "", elsewhere: Optional[Tuple[Sequence[str], str]] = None,
) -> str:
    """``value`` as one of ``choices``, matched case-insensitively and without surrounding spaces.

    Args:
        value: What the user passed.
        choices: The accepted values, in their canonical spelling.
        name: The option's name, for the message.
        what: Optional words after the list of choices (e.g. what each choice means).
        elsewhere: The values of another option of the same name, and what they are there (e.g. the
            prior's ``structure`` for the curvature's): a value of that option is named as one.

    Returns:
        The canonical spelling of the matching choice.

    Raises:
        ValueError: If ``value`` is not a string matching exactly one choice; near misses get a
            "did you mean" suggestion, values of ``elsewhere`` what they are there.
    """
    if isinstance(value, str):
        matches = [c for c in choices if c.lower() == value.strip().lower()]
        if len(matches) == 1:
            return matches[0]
        if value in choices:  # choices that differ only in case: the exact spelling decides
            return value
    extra = f" {what}" if what else ""
    if elsewhere is not None and isinstance(value, str) and value.strip().lower() in [v.lower() for v in elsewhere[0]]:
        extra = f" {value!r} is {elsewhere[1]}.{extra}"
    raise ValueError(f"`{name}` must be one of {tuple(choices)}, got {value!r}{suggestion(value, choices)}.{extra}")


def keywords(given: Mapping[str, Any], accepted: Sequence[str], name: str, what: str) -> None:
    """Refuse the keys of ``given`` that are not in ``accepted``, each with a "did you mean" for a near miss.

    Args:
        given: The keyword arguments the user passed (e.g. ``select_models``' ``callback``).
        accepted: The names the receiver takes.
        name: The option that holds them, for the message.
        what: What takes them (e.g. ``"MargLikCallback"``), for the message.

    Raises:
        ValueError: Naming every unknown key.

    Example:
        >>> keywords({"structre": "full"}, ("structure", "approx"), "callback", "MargLikCallback")
        Traceback (most recent call last):
        ...
        ValueError: `callback` has keys that are not MargLikCallback arguments: 'structre' (did you mean 'structure'?).
    """
    unknown = [key for key in given if key not in accepted]
    if unknown:
        named = ", ".join(f"{key!r}{suggestion(key, accepted)}" for key in unknown)
        raise ValueError(f"`{name}` has keys that are not {what} arguments: {named}.")


def integer(value: Any, name: str, minimum: int = 0, what: str = "", maximum: Optional[int] = None) -> int:
    """``value`` as an int ``>= minimum`` (and ``<= maximum``, if given): any integral number (NumPy's too); ``bool``
    and integral floats are refused (``True`` is not 1 epoch).

    Raises:
        ValueError: Naming the option and the bad value.
    """
    ok = not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= minimum
    if not ok or (maximum is not None and value > maximum):
        extra = f" ({what})" if what else ""
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"`{name}` must be an int {bounds}{extra}, got {value!r}.")
    return int(value)


def flag(value: Any, name: str, what: str = "") -> bool:
    """``value`` if it is a bool: ``1``, ``None`` and the string ``"false"`` (true as a condition) are refused.

    Raises:
        ValueError: Naming the option and the bad value.
    """
    if not isinstance(value, bool):
        extra = f" ({what})" if what else ""
        raise ValueError(f"`{name}` must be True or False{extra}, got {value!r}.")
    return value


def number(
    value: Any, name: str, low: float = 0.0, high: float = math.inf, low_open: bool = True,
    high_open: bool = False, what: str = "",
) -> float:
    """``value`` as a finite float in the interval ``low .. high`` (open or closed at either end).

    The default interval is ``(0, inf)``: a positive finite number. Any real number is taken (NumPy's too), and a
    one-element tensor as the number it holds, as the hyperparameters' values take it (``precision=torch.tensor(2.)``).

    Raises:
        ValueError: Naming the option, the interval and the bad value (``bool``, strings, NaN and
            infinities included).
    """
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open or math.isinf(high) else ']'}"
        extra = f" ({what})" if what else ""
        raise ValueError(f"`{name}` must be a finite number in {interval}{extra}, got {value!r}.")
    return float(value)


def optional(check: Any, value: Any, *args: Any, **kwargs: Any) -> Optional[Any]:
    """``None`` for ``None``, else ``check(value, *args, **kwargs)``."""
    return None if value is None else check(value, *args, **kwargs)
