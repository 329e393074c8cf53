"""The one exception type users see: its message is the whole one-line error."""


class GraphxformError(Exception):
    """A problem with the user's input or options; the CLI prints it as one line."""


class PassError(GraphxformError):
    """A pass failed; the message names the pass and the passes that ran before it."""
