"""Printing in the project's notation; ``rewriter.parse`` reads every printed object back.

Parentheses appear only where the tree needs them (left-associative, usual precedence), so
printing a parsed text gives the text back in its normal spacing.
"""

from __future__ import annotations

from .ir import (
    REDUCTIONS,
    Access,
    Binary,
    Index,
    IndexNeg,
    IndexOp,
    Lit,
    Num,
    Program,
    Scalar,
    Scope,
    Tensor,
    Unary,
    Var,
)

_ADD, _MUL, _NEG, _ATOM = 1, 2, 3, 4
_PRECEDENCE = {"+": _ADD, "-": _ADD, "*": _MUL, "/": _MUL, "%": _MUL}


def _index_precedence(ix: Index) -> int:
    match ix:
        case IndexOp(op, _, _):
            return _PRECEDENCE[op]
        case IndexNeg():
            return _NEG
        case Lit(value) if value < 0:
            return _NEG
    return _ATOM


def _wrap(text: str, inner: int, needed: int) -> str:
    return f"({text})" if inner < needed else text


def format_index(ix: Index) -> str:
    match ix:
        case Var(name):
            return name
        case Lit(value):
            return str(value)
        case IndexNeg(arg):
            # "-(2)" keeps IndexNeg(Lit(2)) apart from Lit(-2), which prints "-2"
            text = format_index(arg)
            return "-" + (f"({text})" if _index_precedence(arg) <= _NEG or isinstance(arg, Lit) else text)
        case IndexOp(op, lhs, rhs):
            prec = _PRECEDENCE[op]
            left = _wrap(format_index(lhs), _index_precedence(lhs), prec)
            right = _wrap(format_index(rhs), _index_precedence(rhs), prec + 1)
            return f"{left}{op}{right}"
    raise TypeError(f"not an index: {ix!r}")


def format_number(value: float) -> str:
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def _scalar_precedence(body: Scalar) -> int:
    match body:
        case Binary(op, _, _) if op in _PRECEDENCE:
            return _PRECEDENCE[op]
        case Unary("neg", _):
            return _NEG
        case Num(value) if value < 0 or str(value).startswith("-"):
            return _NEG
    return _ATOM


def format_scalar(body: Scalar) -> str:
    match body:
        case Num(value):
            return format_number(value)
        case Access(source, indices):
            name = source.name if isinstance(source, Tensor) else "{ " + format_scope(source) + " }"
            return f"{name}[{', '.join(format_index(ix) for ix in indices)}]"
        case Unary("neg", arg):
            text = format_scalar(arg)
            return "-" + (f"({text})" if _scalar_precedence(arg) <= _NEG or isinstance(arg, Num) else text)
        case Unary(fn, arg):
            return f"{fn}({format_scalar(arg)})"
        case Binary(op, lhs, rhs) if op in _PRECEDENCE:
            prec = _PRECEDENCE[op]
            left = _wrap(format_scalar(lhs), _scalar_precedence(lhs), prec)
            right = _wrap(format_scalar(rhs), _scalar_precedence(rhs), prec + 1)
            return f"{left} {op} {right}"
        case Binary(fn, lhs, rhs):
            return f"{fn}({format_scalar(lhs)}, {format_scalar(rhs)})"
    raise TypeError(f"not a scalar: {body!r}")


def format_scope(scope: Scope) -> str:
    parts = ["L " + ", ".join(map(str, scope.traversal)) if scope.traversal else "L"]
    if scope.summation:
        parts.append(REDUCTIONS[scope.reduce] + " " + ", ".join(map(str, scope.summation)))
    parts.append(format_scalar(scope.body))
    return " ; ".join(parts)


def format_program(program: Program) -> str:
    lines = [f"{name} = {format_scope(expr)}" for name, expr in program.definitions]
    lines.append("return " + ", ".join(program.outputs))
    return "\n".join(lines)
