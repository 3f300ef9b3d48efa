"""The one exception type for data problems a user can fix (missing files, corruption, bad settings)."""


class DataError(ValueError):
    """A data problem the user can fix; the message names the file or value and says how."""
