"""The one error type users see for malformed expressions."""


class ExpressionError(ValueError):
    """A malformed expression, builder call or text; the message names the culprit."""
