"""Channel blocking: the stored layout of a program's NCHW tensors (OLLIE 4.2's variable
substitution applied to the traversal that stores a tensor)."""

from rewriter.index import simplify
from rewriter.ir import (
    Access,
    Iterator,
    Lit,
    Program,
    Scope,
    Tensor,
    Var,
    accesses,
    index_vars,
    map_accesses,
    substitute,
    substitute_index,
    tensor_shapes,
)
from rewriter.search.dsl import fresh_name, rule

BLOCKS = (16, 8, 4, 2)  # block sizes tried, largest first: a CPU's vector lanes of float32 and below


@rule("channel blocking", section="4.2", kind="layout")
def block_channels(program: Program):
    """Store every NCHW tensor whose channels ``b`` divides as NCHW{b}c (MLAS's layout on x86):
    a variable substitution c = b*co + ci of the traversal that stores it, ci moved innermost,
    and every read of it re-indexed the same way:

        T = L n, c, h, w ; f(c)          =>   T' = L n, co:C/b, h, w, ci:b ; f(b*co + ci)
        U = ... T[n, e, y, x] ...        =>   U  = ... T'[n, e/b, y, x, e%b] ...
        (T an output)                    =>   T' as above ; T = L n, c, h, w ; T'[n, c/b, h, w, c%b]

    A scope nested in T's and read at exactly c is stored the same way (the convolution inside
    a bias and an activation), and a reader's summation iterator that indexes T's channels
    exactly is split too (``S c`` => ``S co, ci``), so its reads become ``T'[n, co, y, x, ci]``
    and a vector along ci loads one run of memory. One variant per block size of ``BLOCKS``,
    each blocking every tensor that size divides: a definition of rank 4 (not an output's copy
    back), stored from 0 along its channels, and read by scopes only (an opaque operation reads the
    layout as written). Readers keep their own layout unless blocked themselves. A program's
    output is stored blocked too and copied back to its own layout by a definition of its name,
    as onnxruntime reorders its NCHWc outputs (``_unblocked``): the convolution that makes it
    then runs as the others do (ResNet-50's last one, NCHW as written, ran as a product over
    a copy of its input unfolded, 1.3-2.5 ms in place against about 1 blocked).
    """
    readers: dict[str, list] = {}
    for name, expr in program.definitions:
        for tensor in tensor_shapes(expr):
            readers.setdefault(tensor, []).append(expr)
    for block in BLOCKS:
        chosen = [
            name
            for name, expr in program.definitions
            if isinstance(expr, Scope)
            and not (name in program.outputs and _copy(expr))  # an output copied back already
            and len(expr.shape) == 4
            and expr.traversal[1].lo == 0
            and expr.shape[1] % block == 0
            and all(isinstance(reader, Scope) for reader in readers.get(name, []))
        ]
        if chosen:
            yield _blocked(program, chosen, block)


def _copy(scope: Scope) -> bool:
    """Whether ``scope`` only reads one tensor at new indices (blocking it would only move it)."""
    return not scope.summation and isinstance(scope.body, Access) and isinstance(scope.body.source, Tensor)


def _blocked(program: Program, names: list[str], block: int) -> Program:
    """``program`` with each tensor of ``names`` stored blocked along its dimension 1."""
    taken = {name for name, _ in program.definitions} | set(program.inputs)
    renamed = {}
    for name in names:
        renamed[name] = fresh_name(f"{name}_{block}c", taken)
        taken.add(renamed[name])
    definitions = []
    for name, program_expr in program.definitions:
        expr = program_expr
        if isinstance(expr, Scope):
            for tensor in set(tensor_shapes(expr)) & set(renamed):
                expr = _reading_blocked(expr, tensor, renamed[tensor], block)
            if name in renamed:
                expr = _stored_blocked(expr, 1, block)
            expr = _simplified(expr)
        definitions.append((renamed.get(name, name), expr))
        if name in renamed and name in program.outputs:  # the output itself, copied back
            definitions.append((name, _unblocked(program_expr, renamed[name], expr.shape, block)))
    return Program(tuple(definitions), program.outputs)


def _unblocked(output: Scope, blocked: str, shape: tuple[int, ...], block: int) -> Scope:
    """Output ``output`` read back from ``blocked`` (stored NCHW{block}c, of ``shape``) into its
    own layout: ``L n, c, h, w ; T'[n, c/b, h, w, c%b]``."""
    n, c, h, w = (Var(it.name) for it in output.traversal)
    read = Tensor(blocked, shape)[n, c // block, h, w, c % block]
    return _simplified(Scope(output.traversal, (), read))


def _split(scope: Scope, it: Iterator, block: int) -> tuple[Iterator, Iterator, dict]:
    """Fresh iterators ``it``o and ``it``i for ``it = block*o + i``, and that substitution."""
    taken = {other.name for other in scope.iterators}
    outer = Iterator(fresh_name(f"{it.name}o", taken), 0, it.size // block)
    inner = Iterator(fresh_name(f"{it.name}i", taken | {outer.name}), 0, block)
    return outer, inner, {it.name: Var(outer.name) * block + Var(inner.name)}


def _stored_blocked(scope: Scope, axis: int, block: int) -> Scope:
    """``scope`` with traversal ``axis`` split into its blocks (in place) and the offset within a
    block (innermost); a nested scope read at exactly that iterator is stored the same way."""
    channel = scope.traversal[axis]
    outer, inner, mapping = _split(scope, channel, block)

    def read(access: Access) -> Access:
        source, indices = access.source, tuple(substitute_index(ix, mapping) for ix in access.indices)
        at = _exact_axis(access, channel.name, scope) if isinstance(source, Scope) else None
        if at is not None and (source.traversal[at].lo, source.traversal[at].size) == (0, channel.size):
            nested = _stored_blocked(source, at, block)
            return Access(nested, indices[:at] + (Var(outer.name),) + indices[at + 1 :] + (Var(inner.name),))
        return Access(source, indices)

    traversal = scope.traversal[:axis] + (outer,) + scope.traversal[axis + 1 :] + (inner,)
    return Scope(traversal, scope.summation, map_accesses(scope.body, read), scope.reduce)


def _reading_blocked(scope: Scope, name: str, blocked: str, block: int) -> Scope:
    """``scope`` reading tensor ``name`` from ``blocked`` (its dimension 1 in blocks), in nested
    scopes too; a summation iterator that alone indexes dimension 1 of every read is split."""
    reads = [a for a in accesses(scope.body) if isinstance(a.source, Tensor) and a.source.name == name]
    for it in scope.summation:
        if reads and it.lo == 0 and it.size % block == 0 and all(_exact_axis(a, it.name, scope) == 1 for a in reads):
            outer, inner, mapping = _split(scope, it, block)
            at = scope.summation.index(it)
            summation = scope.summation[:at] + (outer, inner) + scope.summation[at + 1 :]
            scope = Scope(scope.traversal, summation, substitute(scope.body, mapping), scope.reduce)
            break

    def read(access: Access) -> Access:
        source, ix = access.source, access.indices
        if isinstance(source, Scope):
            return Access(_reading_blocked(source, name, blocked, block), ix)
        if source.name != name:
            return access
        shape = source.shape[:1] + (source.shape[1] // block,) + source.shape[2:] + (block,)
        return Tensor(blocked, shape)[ix[:1] + (ix[1] // block,) + ix[2:] + (ix[1] % block,)]

    return scope.with_body(map_accesses(scope.body, read))


def _exact_axis(access: Access, name: str, scope: Scope) -> int | None:
    """The one dimension that ``access`` reads at exactly iterator ``name`` (unit iterators of
    ``scope`` at their value), where no other dimension reads ``name``; else None."""
    units = {it.name: Lit(it.lo) for it in scope.iterators if it.size == 1}
    indices = [simplify(substitute_index(ix, units), scope.box) for ix in access.indices]
    exact = [d for d, ix in enumerate(indices) if ix == Var(name)]
    if len(exact) != 1 or any(name in index_vars(ix) for d, ix in enumerate(indices) if d != exact[0]):
        return None
    return exact[0]


def _simplified(scope: Scope) -> Scope:
    """Every index brought to its simplest form over its scope's box, nested scopes too
    (``(b*co + ci) / b`` => ``co``)."""
    box = scope.box

    def read(access: Access) -> Access:
        source = _simplified(access.source) if isinstance(access.source, Scope) else access.source
        return Access(source, tuple(simplify(ix, box) for ix in access.indices))

    return scope.with_body(map_accesses(scope.body, read))
