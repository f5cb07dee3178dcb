"""An answer's text as it streams: incremental detokenization and stop strings.

:class:`IncrementalDetokenizer` turns each new token into the text it adds, decoding only a
short window (vLLM's prefix offsets), not the whole answer per token. The window starts at the
token after the last one whose text was emitted: ``prefix_text = decode(ids[prefix:read])`` and
``decode(ids[prefix:])`` differ by the new text, except while it ends in an incomplete UTF-8
sequence (U+FFFD), which waits for the next token.

:class:`StopStrings` matches stop strings of any length on that text::

    emitted | held back (a suffix that is a prefix of a stop) | ...
    "Hello U" "ser"  ->  stop "User:" may start at "U": "U" is held back; "User:" found: the
    answer is "Hello " and the turn finishes with reason "stop"

Text is released only when no stop string can start in it, so a stop string never reaches the
client even when it spans several tokens or chunks.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Text added by each new token of one answer."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.options = {"skip_special_tokens": skip_special_tokens}
        """``decode``'s arguments (vLLM's fields of the same names)."""
        if not spaces_between_special_tokens:
            self.options["spaces_between_special_tokens"] = False
        self.ids: list[int] = []
        self.prefix = 0
        """First token of the decode window."""
        self.read = 0
        """Tokens whose text was emitted."""

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, **self.options))

    def add(self, token: int) -> str:
        """The text ``token`` completes (possibly empty)."""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever the last tokens decode to (an incomplete sequence, as U+FFFD)."""
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


class StopStrings:
    """Stop-string matching over streamed text; :meth:`feed` returns the text safe to emit."""

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include
        """Keep the stop string that matched in :attr:`text` (vLLM's
        ``include_stop_str_in_output``)."""
        self.first_chars = {s[0] for s in self.stops}
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        """All text so far (emitted and held back)."""
        self.emitted = 0
        self.stopped = False

    def feed(self, delta: str, armed: bool = True) -> str:
        """Add ``delta``; return the newly releasable text. After a match, :attr:`stopped` is
        set and the text up to the stop string is released; later calls return ''. Text fed
        with ``armed`` False (before ``min_tokens``) is released unmatched, as vLLM does."""
        if self.stopped:
            return ""
        if not self.stops or not armed:
            self.text += delta
            self.emitted = len(self.text)
            return delta
        start = max(0, len(self.text) - self.longest + 1)
        self.text += delta
        hit, length = -1, 0
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (hit < 0 or i < hit):
                hit, length = i, len(s)
        if hit >= 0:
            self.stopped = True
            self.text = self.text[:hit + (length if self.include else 0)]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held())

    def flush(self) -> str:
        """The answer ended: release what was held back."""
        return "" if self.stopped else self._release(len(self.text))

    def _held(self) -> int:
        """Length of the longest suffix of the text that starts some stop string."""
        text = self.text
        lo = max(self.emitted, len(text) - self.longest + 1)
        for j in range(lo, len(text)):
            if text[j] in self.first_chars:
                tail = text[j:]
                if any(s.startswith(tail) for s in self.stops):
                    return len(text) - j
        return 0

    def _release(self, end: int) -> str:
        out = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out
