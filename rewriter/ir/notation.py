"""The words of the notation: keywords, function names, reductions, precedence and number format.

The single place to add a function to the notation: ``UNARY_FUNCTIONS`` or ``BINARY_FUNCTIONS``
(name -> the numpy function of the reference semantics), then its lowering in codegen.
"""

from __future__ import annotations

import re

from .errors import ExpressionError

# Words the notation reserves: the scope keywords (and the function names below).
KEYWORDS = frozenset({"L", "S", "M", "return"})

# name -> numpy implementation
UNARY_FUNCTIONS = {
    "neg": "negative",
    "relu": "relu",
    "exp": "exp",
    "log": "log",
    "tanh": "tanh",
    "sin": "sin",
    "cos": "cos",
    "sigmoid": "sigmoid",
    "erf": "erf",
    "sqrt": "sqrt",
    "rsqrt": "1 / sqrt",
    "abs": "absolute",
    "floor": "floor",
    "ceil": "ceil",
}
# comparisons give 1.0 where they hold and 0.0 elsewhere (masks are float data)
COMPARISONS = {
    "less": "less",
    "less_equal": "less_equal",
    "greater": "greater",
    "greater_equal": "greater_equal",
    "equal": "equal",
}
# select(c, x) is x where c is not 0 and 0 elsewhere, exactly: where(c, a, b) is
# select(c, a) + select(1 - c, b), so a branch not chosen (an infinity, a NaN) never reaches the result
SELECT = {"select": "where(c != 0, x, 0)"}
BINARY_FUNCTIONS = {"max": "maximum", "min": "minimum", "pow": "power", **COMPARISONS, **SELECT}
ARITHMETIC = ("+", "-", "*", "/")
INDEX_OPS = ("+", "-", "*", "/", "%")
REDUCTIONS = {"sum": "S", "max": "M"}  # reduction -> its letter in the notation

# Precedence of printed operators: parentheses appear only where the tree needs them.
ADD, MUL, NEG, ATOM = 1, 2, 3, 4
PRECEDENCE = {"+": ADD, "-": ADD, "*": MUL, "/": MUL, "%": MUL}

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z_0-9]*\Z")


_CHECKED: set[str] = set()  # names already accepted: IR nodes are built by the million in a search


def check_name(kind: str, name: object) -> None:
    """Refuse a tensor or iterator name that is no identifier or a reserved word."""
    if type(name) is str and name in _CHECKED:
        return
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise ExpressionError(f"{kind} name {name!r} is not an identifier")
    if name in KEYWORDS or name in UNARY_FUNCTIONS or name in BINARY_FUNCTIONS:
        raise ExpressionError(f"{kind} name {name!r} is a reserved word of the notation")
    _CHECKED.add(name)


def as_int(value: object, what: str) -> int:
    """An int from an int or a numpy integer; anything else (floats, bools) is refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        if hasattr(value, "__index__") and not isinstance(value, bool):
            return int(value.__index__())  # type: ignore[union-attr]
        raise ExpressionError(f"{what} must be an integer, got {value!r}")
    return value


def wrap(text: str, inner: int, needed: int) -> str:
    """``text`` in parentheses when its precedence is below the one its position needs."""
    return f"({text})" if inner < needed else text


def format_number(value: float) -> str:
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def cached_hash(self) -> int:
    """Hash of a frozen IR node, computed once: trees are hashed often (memo and e-graph keys)."""
    try:
        return self._hash
    except AttributeError:
        cached = hash((type(self).__name__, *(getattr(self, name) for name in self.__dataclass_fields__)))
        object.__setattr__(self, "_hash", cached)
        return cached
