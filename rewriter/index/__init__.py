"""Index algebra: normal forms, bounds and simplification (``algebra``), integer-set queries with
islpy (``sets``), and the bijection check behind variable substitution (``bijection``).

Depends on the language (``rewriter.ir``) only.
"""

from .algebra import (
    Div,
    LinearForm,
    Mod,
    Ranges,
    affine_coefficients,
    affine_index,
    as_ranges,
    index_bounds,
    normalize,
    row_major,
    simplify,
    simplify_form,
    to_index,
    with_remainders,
)
from .bijection import check_substitution
from .sets import (
    equal_on,
    image_box,
    index_map,
    inverse,
    is_bijective,
    is_injective,
    isl_box,
    isl_index,
    isl_name,
    padding_support,
    read_bounds,
    reads_outside,
    vanishes_outside,
)

__all__ = [
    "Div",
    "LinearForm",
    "Mod",
    "Ranges",
    "affine_coefficients",
    "affine_index",
    "as_ranges",
    "check_substitution",
    "equal_on",
    "image_box",
    "index_bounds",
    "index_map",
    "inverse",
    "is_bijective",
    "is_injective",
    "isl_box",
    "isl_index",
    "isl_name",
    "normalize",
    "padding_support",
    "read_bounds",
    "reads_outside",
    "row_major",
    "simplify",
    "simplify_form",
    "to_index",
    "vanishes_outside",
    "with_remainders",
]
