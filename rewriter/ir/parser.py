"""Reading the notation: ``parse(text, shapes)`` and ``parse_program(text, shapes)``.

Grammar (``//`` marks comments in this docstring only)::

    scope   := 'L' [iter {',' iter}] [(';' 'S' | ';' 'M') iter {',' iter}] ';' sum
    iter    := NAME ':' INT                  // range [0, INT)
             | NAME ':' INT '..' INT         // range [lo, hi)
    sum     := prod {('+' | '-') prod}
    prod    := unary {('*' | '/') unary}     // in indices also '%'; '/' is floor division there
    unary   := '-' NUMBER | '-' unary | atom
    atom    := NUMBER | '(' sum ')' | NAME '(' sum {',' sum} ')' | NAME '[' index {',' index} ']'
             | '{' scope '}' '[' index {',' index} ']'
    opaque  := NAME '(' NAME {',' NAME} [';' NAME '=' INT {',' NAME '=' INT}] ')'
                                             // a definition only: gather(W, ids; axis=0)

Every error is an ExpressionError that says where (line and column) and what.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ExpressionError
from .indices import Index, IndexNeg, IndexOp, Lit, Var
from .nodes import OPAQUE_OPS, Access, Binary, Definition, Iterator, Num, Opaque, Program, Scalar, Scope, Tensor, Unary
from .notation import BINARY_FUNCTIONS, UNARY_FUNCTIONS

_TOKEN = re.compile(
    r"(?P<space>[ \t\r]+|\#[^\n]*)"
    r"|(?P<newline>\n)"
    r"|(?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)"
    r"|(?P<name>[A-Za-z_][A-Za-z_0-9]*)"
    r"|(?P<punct>\.\.|[\[\]{}(),;:+\-*/%=])"
)


@dataclass(frozen=True)
class Token:
    kind: str  # number, name, punct, newline, end
    text: str
    line: int
    column: int


def tokenize(text: str) -> list[Token]:
    tokens, line, line_start, pos = [], 1, 0, 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        column = pos - line_start + 1
        if not match:
            raise ExpressionError(f"line {line}, column {column}: unexpected character {text[pos]!r}")
        kind = match.lastgroup
        if kind == "newline":
            tokens.append(Token("newline", "\n", line, column))
            line, line_start = line + 1, match.end()
        elif kind != "space":
            tokens.append(Token(kind, match.group(), line, column))  # type: ignore[arg-type]
        pos = match.end()
    tokens.append(Token("end", "", line, pos - line_start + 1))
    return tokens


class _Parser:
    def __init__(self, text: str, shapes: dict | None, newlines: bool = False):
        self.tokens = [t for t in tokenize(text) if newlines or t.kind != "newline"]
        self.pos = 0
        self.shapes = {name: tuple(shape) for name, shape in (shapes or {}).items()}
        self.tensors: dict[str, Tensor] = {}
        self.bound: set[str] = set()

    # -- token helpers
    @property
    def token(self) -> Token:
        return self.tokens[self.pos]

    def error(self, message: str, token: Token | None = None) -> ExpressionError:
        token = token or self.token
        return ExpressionError(f"line {token.line}, column {token.column}: {message}")

    def describe(self, token: Token) -> str:
        return (
            "end of input" if token.kind == "end" else ("end of line" if token.kind == "newline" else repr(token.text))
        )

    def accept(self, text: str) -> Token | None:
        if self.token.text == text and self.token.kind in ("punct", "name"):
            token = self.token
            self.pos += 1
            return token
        return None

    def expect(self, text: str, context: str) -> Token:
        token = self.accept(text)
        if token is None:
            raise self.error(f"expected {text!r} {context}, found {self.describe(self.token)}")
        return token

    def take(self, kind: str, context: str) -> Token:
        if self.token.kind != kind:
            raise self.error(
                f"expected {'a ' + kind if kind != 'end' else 'end of input'} {context}, found {self.describe(self.token)}"
            )
        token = self.token
        self.pos += 1
        return token

    def build(self, token: Token, make):
        """Build an IR node; a validation error gets the position of ``token``."""
        try:
            return make()
        except ExpressionError as err:
            raise self.error(str(err), token) from None

    # -- scopes
    def scope(self) -> Scope:
        start = self.token
        if not self.accept("L"):
            raise self.error(f"expected a scope starting with 'L', found {self.describe(start)}")
        traversal = self.iterators()
        summation, reduce = (), "sum"
        self.expect(";", "after the traversal iterators")
        for letter, kind in (("S", "sum"), ("M", "max")):
            if self.token.text == letter and self.tokens[self.pos + 1].kind == "name":
                self.pos += 1
                summation, reduce = self.iterators(), kind
                if not summation:
                    raise self.error(f"expected iterators after '{letter}'")
                self.expect(";", "after the summation iterators")
                break
        outer_bound = self.bound
        self.bound = {it.name for it in traversal + summation}
        body = self.sum(index=False)
        self.bound = outer_bound
        return self.build(start, lambda: Scope(traversal, summation, body, reduce))

    def definition(self) -> Definition:
        """A scope, or an opaque operation: ``gather(W, ids; axis=0)``."""
        start = self.token
        if start.text not in OPAQUE_OPS or self.tokens[self.pos + 1].text != "(":
            return self.scope()
        self.pos += 2
        inputs = [self.tensor(self.take("name", f"as an input of {start.text}"))]
        while self.accept(","):
            inputs.append(self.tensor(self.take("name", f"as an input of {start.text}")))
        attributes = []
        if self.accept(";"):
            while True:
                key = self.take("name", f"as an attribute of {start.text}")
                self.expect("=", f"after {key.text}")
                attributes.append((key.text, self.integer(f"as the value of {key.text}")))
                if not self.accept(","):
                    break
        self.expect(")", f"to close {start.text}(...)")
        return self.build(start, lambda: Opaque(start.text, tuple(inputs), tuple(attributes)))

    def iterators(self) -> tuple[Iterator, ...]:
        result: list[Iterator] = []
        if self.token.kind != "name":
            return ()
        while True:
            name = self.take("name", "for an iterator")
            self.expect(":", f"after iterator {name.text}")
            lo, hi = 0, self.integer(f"for the range of {name.text}")
            if self.accept(".."):
                lo, hi = hi, self.integer(f"for the end of the range of {name.text}")
            result.append(self.build(name, lambda: Iterator(name.text, lo, hi)))
            if not self.accept(","):
                return tuple(result)

    def integer(self, context: str) -> int:
        sign = -1 if self.accept("-") else 1
        token = self.take("number", context)
        if not token.text.isdigit():
            raise self.error(f"expected an integer {context}, found {token.text!r}", token)
        return sign * int(token.text)

    # -- expressions (index=True parses index expressions)
    def sum(self, index: bool):
        node = self.product(index)
        while self.token.text in ("+", "-") and self.token.kind == "punct":
            op = self.token
            self.pos += 1
            rhs = self.product(index)
            node = self.binary(op, node, rhs, index)
        return node

    def product(self, index: bool):
        node = self.unary(index)
        ops = ("*", "/", "%") if index else ("*", "/")
        while self.token.kind == "punct" and self.token.text in ops:
            op = self.token
            self.pos += 1
            rhs = self.unary(index)
            node = self.binary(op, node, rhs, index)
        if not index and self.token.text == "%" and self.token.kind == "punct":
            raise self.error("'%' is only allowed in indices")
        return node

    def binary(self, op: Token, lhs, rhs, index: bool):
        if index:
            return self.build(op, lambda: IndexOp(op.text, lhs, rhs))
        return self.build(op, lambda: Binary(op.text, lhs, rhs))

    def unary(self, index: bool):
        minus = self.accept("-")
        if minus:
            if self.token.kind == "number":
                return self.number(index, negative=True)
            arg = self.unary(index)
            return IndexNeg(arg) if index else Unary("neg", arg)
        return self.atom(index)

    def number(self, index: bool, negative: bool = False):
        token = self.take("number", "")
        text = ("-" if negative else "") + token.text
        if index:
            if not token.text.isdigit():
                raise self.error(f"non-integer index constant {text}", token)
            return Lit(int(text))
        return self.build(token, lambda: Num(float(text)))

    def atom(self, index: bool):
        token = self.token
        if token.kind == "number":
            return self.number(index)
        if self.accept("("):
            node = self.sum(index)
            self.expect(")", "to close '('")
            return node
        if self.accept("{"):
            if index:
                raise self.error("a nested scope cannot stand in an index", token)
            outer_bound = self.bound
            inner = self.scope()
            self.bound = outer_bound
            self.expect("}", "to close the nested scope")
            return self.access(token, inner)
        if token.kind != "name":
            raise self.error(f"expected {'an index' if index else 'an expression'}, found {self.describe(token)}")
        self.pos += 1
        if index:
            if token.text not in self.bound:
                bound = ", ".join(sorted(self.bound)) or "none"
                raise self.error(f"unbound iterator {token.text!r} (iterators of this scope: {bound})", token)
            return Var(token.text)
        if self.token.text == "(" and self.token.kind == "punct":
            return self.call(token)
        if self.token.text == "[" and self.token.kind == "punct":
            return self.access(token, self.tensor(token))
        raise self.error(f"expected a tensor access {token.text}[...] or a call {token.text}(...)", token)

    def call(self, name: Token) -> Scalar:
        self.expect("(", "")
        args = [self.sum(index=False)]
        while self.accept(","):
            args.append(self.sum(index=False))
        self.expect(")", f"to close the call of {name.text}")
        if name.text in UNARY_FUNCTIONS and name.text != "neg":
            if len(args) != 1:
                raise self.error(f"{name.text} takes 1 argument, got {len(args)}", name)
            return Unary(name.text, args[0])
        if name.text in BINARY_FUNCTIONS:
            if len(args) != 2:
                raise self.error(f"{name.text} takes 2 arguments, got {len(args)}", name)
            return Binary(name.text, args[0], args[1])
        known = sorted(set(UNARY_FUNCTIONS) - {"neg"} | set(BINARY_FUNCTIONS))
        raise self.error(f"unknown function {name.text!r}; known: {', '.join(known)}", name)

    def tensor(self, name: Token) -> Tensor:
        if name.text not in self.tensors:
            if name.text not in self.shapes:
                given = ", ".join(sorted(self.shapes)) or "none"
                raise self.error(f"unknown tensor {name.text!r} (shapes given for: {given})", name)
            self.tensors[name.text] = self.build(name, lambda: Tensor(name.text, self.shapes[name.text]))
        return self.tensors[name.text]

    def access(self, start: Token, source) -> Access:
        self.expect("[", f"after {source.name if isinstance(source, Tensor) else 'the nested scope'}")
        if self.accept("]"):  # a rank-0 read
            return self.build(start, lambda: Access(source, ()))
        indices: list[Index] = [self.sum(index=True)]
        while self.accept(","):
            indices.append(self.sum(index=True))
        self.expect("]", "to close the indices")
        return self.build(start, lambda: Access(source, tuple(indices)))


def parse(text: str, shapes: dict | None = None) -> Definition:
    """Parse one expression in the notation (a scope, or an opaque operation); ``shapes`` maps
    each input tensor to its shape."""
    if not isinstance(text, str):
        raise ExpressionError(f"parse() takes the expression text, got {type(text).__name__}")
    parser = _Parser(text, shapes)
    scope = parser.definition()
    parser.take("end", "after the expression")
    return scope


def parse_program(text: str, shapes: dict | None = None) -> Program:
    """Parse lines ``NAME = scope`` ending with ``return NAME, ...``; later lines read earlier names."""
    parser = _Parser(text, shapes, newlines=True)
    given = set(parser.shapes)
    definitions: list[tuple[str, Definition]] = []
    outputs: list[str] = []
    while True:
        while parser.token.kind == "newline":
            parser.pos += 1
        if parser.token.kind == "end":
            break
        if parser.accept("return"):
            outputs.append(parser.take("name", "after 'return'").text)
            while parser.accept(","):
                outputs.append(parser.take("name", "after ','").text)
            continue
        name = parser.take("name", "at the start of a definition")
        parser.expect("=", f"after {name.text}")
        expr = parser.definition()
        if parser.token.kind not in ("newline", "end"):
            raise parser.error(
                f"expected end of line after the definition of {name.text}, found {parser.describe(parser.token)}"
            )
        if any(name.text == defined for defined, _ in definitions):
            raise parser.error(f"tensor {name.text} is defined twice", name)
        if name.text in given:
            raise parser.error(f"tensor {name.text} is given a shape as an input and is also defined", name)
        definitions.append((name.text, expr))
        parser.shapes[name.text] = expr.shape  # later lines read it as a tensor
    if not outputs and definitions:
        outputs.append(definitions[-1][0])
    return parser.build(parser.token, lambda: Program(tuple(definitions), tuple(outputs)))
