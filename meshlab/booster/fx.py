"""``is_compatible_with_meta``: whether models can be built on the meta device (what
``LazyInitContext`` does); torch has had full meta support since 2.0, so always True."""


def is_compatible_with_meta() -> bool:
    """True: ``LazyInitContext`` builds any model on the meta device."""
    return True
