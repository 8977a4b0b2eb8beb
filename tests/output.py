"""Finds the line of a command's output that reports an error, as a person reading it would,
wherever it falls among the progress lines and notes the command prints (a slow or busy
machine prints more of them).

Usage:
    assert error_line(result.stderr) == "error: --json x is a folder; give a file"
    assert "holds NaN" in error_line(result.stderr)
    error_line(stderr, "interrupted")     # "interrupted: run the same command again ..."
"""


def error_line(stderr: str | bytes, label: str = "error") -> str:
    """The one line of `stderr` that starts with "LABEL: ", after checking that it is a whole
    report in one line: exactly one line starts that way, there is no traceback, and nothing
    follows it, because a command stops once it reports. Lines before it (progress, notes)
    are not checked."""
    text = stderr.decode() if isinstance(stderr, bytes) else stderr
    lines = [line for line in text.splitlines() if line.strip()]
    reports = [line for line in lines if line.startswith(f"{label}: ")]
    assert "Traceback" not in text, text
    assert len(reports) == 1 and lines[-1] == reports[0], text
    return reports[0]
