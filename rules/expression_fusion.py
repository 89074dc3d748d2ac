"""Expression fusion and merging across the expressions of a program (OLLIE 4.1, Figure 5)."""

from rewriter.dsl import rule
from rewriter.ir import Iterator, Program, Scope, Tensor, Var, replace_reads, tensor_shapes


def _readers(program: Program, name: str) -> list[str]:
    return [n for n, e in program.definitions if name in tensor_shapes(e)]


def _with_body(scope: Scope, body) -> Scope:
    return Scope(scope.traversal, scope.summation, body, scope.reduce)


@rule("expression fusion", section="4.1", kind="inter", takes="program")
def fuse_expressions(program: Program):
    """Fuse a producer into its only consumer by the chain rule (OLLIE 4.1):

        T = L x ; f    and    U = L y ; g(T[pi(y)])    =>    U = L y ; g({ L x ; f }[pi(y)])

    (shifted by the start of x's range when it is not 0: T is stored from 0). The producer becomes a nested scope (still instantiated once), so later derivation can merge
    traversals across what were two operators. Not applied to outputs or shared producers.
    """
    defined = dict(program.definitions)
    for name, producer in program.definitions:
        readers = _readers(program, name)
        if name in program.outputs or len(readers) != 1:
            continue
        consumer = readers[0]
        # a program tensor is stored from 0, a nested scope is read in its iterators' coordinates
        def read(indices, producer=producer):
            return producer[tuple(ix + it.lo for ix, it in zip(indices, producer.traversal))]

        fused = _with_body(defined[consumer], replace_reads(defined[consumer].body, name, read))
        definitions = tuple((n, fused if n == consumer else e) for n, e in program.definitions if n != name)
        yield Program(definitions, program.outputs)


def _differ_in_one_input(first: Scope, second: Scope):
    """The one pair of input tensors (same shape) whose renaming makes the scopes equal, or None."""
    a_names, b_names = tensor_shapes(first), tensor_shapes(second)
    only_a, only_b = set(a_names) - set(b_names), set(b_names) - set(a_names)
    if len(only_a) != 1 or len(only_b) != 1:
        return None
    (a,), (b,) = only_a, only_b
    if a_names[a] != b_names[b] or first.traversal != second.traversal:
        return None
    renamed = _with_body(second, replace_reads(second.body, b, lambda ix: Tensor(a, b_names[b])[ix]))
    return (a, b) if renamed == first else None


@rule("expression merging (batch)", section="4.1", kind="inter", takes="program")
def merge_into_batch(program: Program):
    """Merge two expressions that differ only in one input into one batched expression (4.1):

        U1 = L x ; f(A1, B)    U2 = L x ; f(A2, B)
    =>  UB = L b:2, x ; f(stack(A1, A2)[b, ...], B) ;  U1 = L x ; UB[0, x] ;  U2 = L x ; UB[1, x]

    ``stack`` is a scope ``{ L b:2, d.. ; A1[d0+D*b, ..] + A2[d0+D*b-D, ..] }`` (each term is
    in bounds for one b only), so several Matmuls sharing B become one BatchMatmul (Figure 5).
    """
    defs = program.definitions
    for i in range(len(defs)):
        for j in range(i + 1, len(defs)):
            (n1, e1), (n2, e2) = defs[i], defs[j]
            pair = _differ_in_one_input(e1, e2)
            if pair is None or n1 in tensor_shapes(e2) or n2 in tensor_shapes(e1):
                continue
            a, b = pair
            shape = tensor_shapes(e1)[a]
            dims = tuple(Iterator(f"d{k}", 0, size) for k, size in enumerate(shape))
            batch = Iterator("b", 0, 2)
            first = (Var("d0") + shape[0] * Var("b"),) + tuple(d.var for d in dims[1:])
            second = (Var("d0") + shape[0] * Var("b") - shape[0],) + tuple(d.var for d in dims[1:])
            stacked = Scope((batch,) + dims, (), Tensor(a, shape)[first] + Tensor(b, shape)[second])
            taken = {it.name for it in e1.iterators}
            bname = next(c for c in ("b", "bb", "batch", "b0") if c not in taken)
            bvar = Var(bname)
            batched = Scope(
                (Iterator(bname, 0, 2),) + e1.traversal,
                e1.summation,
                replace_reads(e1.body, a, lambda ix: stacked[(bvar,) + tuple(ix)]),
                e1.reduce,
            )
            merged_name = next(f"{n1}_{n2}{k or ''}" for k in range(100) if f"{n1}_{n2}{k or ''}" not in dict(defs))
            def read(k):  # the merged tensor is stored from 0 along every axis
                indices = (k,) + tuple(it.var - it.lo for it in e1.traversal)
                return Scope(e1.traversal, (), Tensor(merged_name, batched.shape)[indices])

            definitions = list(defs[:i]) + [(merged_name, batched), (n1, read(0))] + [
                d for d in defs[i + 1 :] if d[0] != n2
            ]
            position = [n for n, _ in definitions].index(n1) + 1
            definitions.insert(position, (n2, read(1)))
            yield Program(tuple(definitions), program.outputs)
