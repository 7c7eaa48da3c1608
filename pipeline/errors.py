"""The error every stage raises for an input of the wrong kind (the nodes name their node in
front of its message)."""


class InputError(ValueError):
    """An input of the wrong kind; the message names the input and what was expected."""
