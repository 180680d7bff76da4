"""The one exception type argument validation raises; parse_args turns it into exit code 2."""


class ArgumentError(ValueError):
    """A user-fixable problem with the command line. The message names the flag."""
