"""The one exception type for bad input: the CLI and the noxfile turn it into one line and exit 2."""


class UserError(Exception):
    """Bad input from the user (a file, a flag, the hardware): one clear line, non-zero exit."""
