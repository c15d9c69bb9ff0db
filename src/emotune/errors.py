"""The one exception type that reaches the user as a message instead of a traceback."""


class UserError(Exception):
    """Bad input (config, data, request, environment): the message names the field and the fix.

    The CLI prints it as one paragraph and exits with status 2; nothing else is caught that way, so a
    real bug still shows its traceback.
    """
