"""A command's output read as a person reads it: the line that reports an error, wherever it
falls among the progress lines and notes that a command prints so that nothing is silent,
and of which a slow or busy machine prints more.

Usage:
    assert error_line(result.stderr) == "error: --json x is a folder; give a file"
    assert "holds NaN" in error_line(result.stderr)
    error_line(stderr, "interrupted")     # "interrupted: run the same command again ..."
"""


def error_line(stderr: str | bytes, label: str = "error") -> str:
    """The one line of `stderr` that starts with "LABEL: ", checked to be a whole report in
    one line: exactly one line starts so, no traceback, and nothing follows it, because a
    command stops where it reports. Lines before it (progress, notes) are the command's."""
    text = stderr.decode() if isinstance(stderr, bytes) else stderr
    lines = [line for line in text.splitlines() if line.strip()]
    reports = [line for line in lines if line.startswith(f"{label}: ")]
    assert "Traceback" not in text, text
    assert len(reports) == 1 and lines[-1] == reports[0], text
    return reports[0]
