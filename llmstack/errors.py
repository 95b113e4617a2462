"""Errors a user can cause. The CLI prints their message, without a traceback, and exits 2."""


class UserError(Exception):
    """A mistake in a config, a path, the data or the launch that the user can fix.

    The message says what is wrong and what to do about it.
    """
