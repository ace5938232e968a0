"""A reply's text as its tokens arrive: whole characters only, cut at the first stop string.

Text that could be the start of a stop string is held back until the next token shows whether
it is one, so a client never receives part of a stop string (OpenAI's behaviour).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..generation.loop import TextStream


class ReplyText:
    """`lstrip`: drop one leading space of the reply, for a chat answer of a SentencePiece model
    (its first token spells the word's space, `▁Hello`: right after a prompt, not as a message)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = (), lstrip: bool = False):
        self.stops = [s for s in stops if s]
        self._lstrip = lstrip
        self.text = ""  # everything decoded so far (cut at the stop string once found)
        self.sent = 0  # characters of `text` handed out
        self.stopped = False
        self._stream = TextStream(decode, self._on_text)

    def _on_text(self, _seq: int, piece: str) -> None:
        if self._lstrip and piece:
            piece, self._lstrip = piece.removeprefix(" "), False
        self.text += piece

    def add(self, token: int) -> str:
        """Feed one token; returns the text that may be shown now ("" while held back)."""
        if self.stopped:
            return ""
        self._stream(0, token)
        return self._release(final=False)

    def finish(self) -> str:
        """The reply ended: whatever was held back, unless a stop string cut it."""
        if self.stopped:
            return ""
        self._stream.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        cut = self._find_stop()
        if cut is not None:
            self.stopped, self.text = True, self.text[:cut]
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return piece

    def _find_stop(self) -> int | None:
        # nothing handed out can start a stop string (it would have been held back)
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _held(self) -> int:
        """Length of the longest unsent tail that is a proper prefix of a stop string."""
        tail = self.text[self.sent:]
        for n in range(min(len(tail), max((len(s) for s in self.stops), default=0)), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stops):
                return n
        return 0
