"""The base of Colossal-AI's mixed-precision objects (``mixed_precision``): what the
Booster reads from one, its ``precision`` transform."""


class PrecisionValue:
    """A mixed-precision object: ``precision`` is its ``meshlab.precision(...)`` value."""

    precision = None
