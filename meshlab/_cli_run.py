"""``meshlab run`` and ``meshlab demo`` (added when training lands)."""


def add_commands(sub) -> None:
    return None
