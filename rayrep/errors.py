"""Errors that end a job with a one-line message, before anything starts."""


class InputError(ValueError):
    """Bad input from the user (a config value, a file, a row in it): jobs report it in one
    line, naming the file, row, field or value, and exit with status 2."""


class ConfigError(InputError):
    """A configuration value is wrong; the message names the field and the value."""
