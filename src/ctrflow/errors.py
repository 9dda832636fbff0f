"""Errors a user can act on; the CLI prints them as one line without a traceback."""


class UserError(Exception):
    """Bad input or mismatched files: the message names the file, line or field and the problem."""
