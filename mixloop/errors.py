"""The error the command line turns into one line and a non-zero exit, without a traceback."""


class UserError(Exception):
    """A problem with the user's input (config, workdir, data) that the user can fix; one-line message."""

    exit_code = 2  # What the command line exits with.
