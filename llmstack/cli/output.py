"""Keeping a command's stdout for its result alone."""

import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from typing import TextIO


@contextmanager
def result_stdout() -> Iterator[TextIO]:
    """Yield the real stdout for the result and send everything else printed meanwhile to stderr.

    DeepSpeed logs to stdout (its handler binds the stdout of the moment it is imported, which
    here is stderr) and zero_to_fp32 prints; piping `llmstack eval` into a JSON reader needs
    stdout to hold the result only.
    """
    result = sys.stdout
    with redirect_stdout(sys.stderr):
        yield result
