"""Checks of integer and number arguments at the engine's edges, with one wording for every error.

Python's ``bool`` is a subclass of ``int``: ``page_size=True`` would pass as a 1 and hide a bug.
Every integer a caller hands the engine (a config field, a command-line option, a request's
token ids) goes through :func:`check_int` or :func:`is_int` once, where it enters, and every
other number through :func:`is_number`; the code behind that edge trusts it.
"""

from __future__ import annotations

from numbers import Integral, Real


def is_int(value: object) -> bool:
    """An integer (Python's or NumPy's) that is not a bool."""
    # A plain int is by far the common case (every token id of every prompt comes through
    # here), and the exact type test is twenty times cheaper than the abstract-class check.
    return type(value) is int or (isinstance(value, Integral) and not isinstance(value, bool))


def is_number(value: object) -> bool:
    """A real number (an integer or a float, Python's or NumPy's) that is not a bool."""
    return isinstance(value, Real) and not isinstance(value, bool)


def check_int(name: str, value: object, *, at_least: int | None = None,
              at_most: int | None = None, error: type[Exception] = ValueError) -> int:
    """``value`` as an ``int`` if it is an integer within the bounds given; else ``error`` (by
    default ``ValueError``) saying ``name``, what is allowed and what came."""
    if is_int(value) and (at_least is None or value >= at_least) \
            and (at_most is None or value <= at_most):
        return int(value)
    if at_most is not None:  # a range: at_most comes with at_least
        allowed = f"an integer in [{at_least}, {at_most}]"
    elif at_least is not None:
        allowed = f"an integer >= {at_least}"
    else:
        allowed = "an integer"
    raise error(f"{name} must be {allowed}, got {value!r}")
