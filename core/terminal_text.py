"""Text from the network, made safe to print on a terminal.

A job name, an address or an error message can come from a peer, a token holder or a
server an operator points a tool at. Written raw, ``\\x1b]0;...\\x07`` retitles the window,
``\\x1b[2J`` clears the screen, an OSC 8 sequence plants a link and U+202E reverses what
follows. ``printable`` is the one rule every operator-facing output applies: ``top``'s
cells and captions, the CLI's error line, ``plugins``' table, and every log line through
``TerminalFormatter``, which ``import clusterwire`` sets on logging's last-resort handler
(what prints a warning when the application configured no logging, as in every
``clusterwire`` command).
"""

from __future__ import annotations

import logging

#: Characters of one printed value (a table cell, an error message) before it is cut.
MAX_CHARS = 1024
#: Characters of one log line's message, and lines of one traceback.
LOG_CHARS = 4096
LOG_LINES = 200

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: object, limit: int = MAX_CHARS) -> str:
    """``text`` (its ``str()`` if it is not a str) as one safe line of at most ``limit``
    characters and a note of what was cut.

    Every character ``str.isprintable()`` refuses -- C0 and C1 controls (ESC, BEL, NUL,
    newlines...), DEL, bidi overrides and other format characters, line and paragraph
    separators, unassigned and private-use code points -- is shown as Python writes it in
    a literal (``\\x1b``, ``\\n``, ``\\u202e``), so no escape sequence reaches the terminal
    and a message that quotes a value with ``repr`` reads the same. (A backslash is left as
    it is: text can spell ``\\x1b`` without being one, which harms nothing.)
    """
    if not isinstance(text, str):
        text = str(text)
    head = text[:limit]
    if head.isprintable():
        out = head
    else:
        pieces, length = [], 0
        for char in head:
            piece = char if char.isprintable() else _escape(char)
            if length + len(piece) > limit:
                break
            pieces.append(piece)
            length += len(piece)
        out = "".join(pieces)
        head = head[:len(pieces)]
    cut = len(text) - len(head)
    return out if not cut else f"{out}...(+{cut} characters)"


def printable_lines(text: str, limit: int = LOG_CHARS, lines: int = LOG_LINES) -> str:
    """``text`` with its line breaks kept and each line made ``printable``; at most
    ``lines`` lines and a note of how many more there were (a traceback)."""
    split = text.split("\n", lines)
    kept = [printable(line, limit) for line in split[:lines]]
    if len(split) > lines:
        kept.append(f"...(+{split[lines].count(chr(10)) + 1} lines)")
    return "\n".join(kept)


class TerminalFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose output is safe on a terminal: the formatted message
    (peers' addresses and errors are its arguments) is one ``printable`` line of at most
    ``LOG_CHARS``, a traceback keeps its lines, each escaped. Set it on the handlers of an
    application that logs clusterwire's records to a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        # Another handler's formatter may have cached the traceback on the record raw.
        cached = record.exc_text
        record.exc_text = printable_lines(cached) if cached and not record.exc_info else None
        try:
            return super().format(record)
        finally:
            record.exc_text = cached

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        return printable(super().formatMessage(record), LOG_CHARS)

    def formatException(self, ei) -> str:  # noqa: N802, ANN001 - logging's name and type
        return printable_lines(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802 - logging's name
        return printable_lines(super().formatStack(stack_info))


def protect_last_resort() -> None:
    """Give logging's last-resort handler (it prints WARNING and above to stderr when no
    handler is configured) a ``TerminalFormatter``; its format stays ``%(message)s``."""
    handler = logging.lastResort
    if handler is not None and not isinstance(handler.formatter, TerminalFormatter):
        handler.setFormatter(TerminalFormatter())
