"""Expression fusion and merging across the expressions of a program (OLLIE 4.1, Figure 5).

Both rules rewrite scopes only: an opaque definition (``rewriter.ir.Opaque``) is neither fused
nor merged, and nothing is fused into it."""

from rewriter.ir import Iterator, Program, Scope, Tensor, Var, inline, nested_scopes, replace_reads, tensor_shapes
from rewriter.search.dsl import rule


def _readers(program: Program, name: str) -> list[str]:
    return [n for n, e in program.definitions if name in tensor_shapes(e)]


@rule("expression fusion", section="4.1", kind="inter")
def fuse_expressions(program: Program):
    """Fuse a producer into its only consumer by the chain rule (OLLIE 4.1):

        T = L x ; f    and    U = L y ; g(T[pi(y)])    =>    U = L y ; g({ L x ; f }[pi(y)])

    (``rewriter.ir.inline``: reads shifted by the start of x's range, T is stored from 0). The
    producer becomes a nested scope (still instantiated once), so later derivation can merge
    traversals across what were two operators. Not applied to outputs or shared producers.
    """
    defined = dict(program.definitions)
    for name, producer in program.definitions:
        readers = _readers(program, name)
        if name in program.outputs or len(readers) != 1:
            continue
        consumer = readers[0]
        if not isinstance(producer, Scope) or not isinstance(defined[consumer], Scope):
            continue
        fused = inline(defined[consumer], name, producer)
        definitions = tuple((n, fused if n == consumer else e) for n, e in program.definitions if n != name)
        yield Program(definitions, program.outputs)


def _differ_in_one_input(first: Scope, second: Scope):
    """The one pair of input tensors (same shape) whose renaming makes the scopes equal, or None.
    The differing input must be read by the scope itself, not inside a nested scope: the batch
    iterator that selects among the stacked inputs is bound by the outer traversal only."""
    a_names, b_names = tensor_shapes(first), tensor_shapes(second)
    only_a, only_b = set(a_names) - set(b_names), set(b_names) - set(a_names)
    if len(only_a) != 1 or len(only_b) != 1:
        return None
    (a,), (b,) = only_a, only_b
    if a_names[a] != b_names[b] or first.traversal != second.traversal:
        return None
    if any(a in tensor_shapes(inner) for inner in nested_scopes(first)):
        return None
    renamed = second.with_body(replace_reads(second.body, b, lambda ix: Tensor(a, b_names[b])[ix]))
    return (a, b) if renamed == first else None


@rule("expression merging (batch)", section="4.1", kind="inter")
def merge_into_batch(program: Program):
    """Merge n expressions that differ only in one input into one batched expression (4.1):

        U1 = L x ; f(A1, B)  ...  Un = L x ; f(An, B)
    =>  UB = L b:n, x ; f(stack(A1, .., An)[b, ...], B) ;  Uj = L x ; UB[j-1, x]

    ``stack`` is a scope ``{ L b:n, d.. ; A1[d0+D*b, ..] + A2[d0+D*b-D, ..] + .. }`` (each term
    is in bounds for one b only), so Matmuls sharing B become one BatchMatmul (Figure 5), and
    the Q, K and V projections of attention one. For each definition, the later ones that
    differ from it in the same input join it. The differing inputs must be program inputs (the
    batched expression replaces the first one, where a later definition may not exist yet),
    read outside nested scopes (b is bound by the outer traversal).
    """
    defs = program.definitions
    defined = dict(defs)
    for i, (n1, e1) in enumerate(defs):
        group, a = [], None
        for n2, e2 in defs[i + 1 :]:
            if not (isinstance(e1, Scope) and isinstance(e2, Scope)):
                continue
            pair = _differ_in_one_input(e1, e2)
            if pair is None or pair[1] in defined or (a is not None and pair[0] != a):
                continue
            members = [n1, n2] + [n for n, _ in group]
            if any(m in tensor_shapes(defined[o]) for m in members for o in members):
                continue  # one reads another: not parallel
            a = pair[0]
            group.append((n2, pair[1]))
        if not group or a in defined:
            continue
        stacked_inputs = [a] + [b for _, b in group]
        yield _batched(program, i, [n1] + [n for n, _ in group], stacked_inputs)


def _batched(program: Program, position: int, members: list[str], inputs: list[str]) -> Program:
    """``program`` with the definitions ``members`` (equal but for reading ``inputs[j]``) computed
    by one batched definition placed at ``position`` and read back as views."""
    defs = program.definitions
    first = dict(defs)[members[0]]
    shape = tensor_shapes(first)[inputs[0]]
    dims = tuple(Iterator(f"d{k}", 0, size) for k, size in enumerate(shape))
    count = len(members)
    terms = [
        Tensor(name, shape)[(Var("d0") + shape[0] * Var("b") - j * shape[0],) + tuple(d.var for d in dims[1:])]
        for j, name in enumerate(inputs)
    ]
    stacked = Scope((Iterator("b", 0, count),) + dims, (), _sum(terms))
    taken = {it.name for it in first.iterators}
    bvar = Var(next(c for c in ("b", "bb", "batch", "b0") if c not in taken))
    batched = Scope(
        (Iterator(bvar.name, 0, count),) + first.traversal,
        first.summation,
        replace_reads(first.body, inputs[0], lambda ix: stacked[(bvar,) + tuple(ix)]),
        first.reduce,
    )
    base = "_".join(members[:2]) + ("_etc" if count > 2 else "")
    merged_name = next(f"{base}{k or ''}" for k in range(100) if f"{base}{k or ''}" not in dict(defs))

    def read(k):  # the merged tensor is stored from 0 along every axis
        indices = (k,) + tuple(it.var - it.lo for it in first.traversal)
        return Scope(first.traversal, (), Tensor(merged_name, batched.shape)[indices])

    kept = [d for d in defs if d[0] not in members]
    views = [(name, read(k)) for k, name in enumerate(members)]
    return Program(tuple(kept[:position] + [(merged_name, batched)] + views + kept[position:]), program.outputs)


def _sum(terms):
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total
