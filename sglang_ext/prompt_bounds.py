"""A prompt's text is bounded before it is tokenized.

SGLang tokenizes a prompt before it checks its length against the model's context: a 20 MB
``text`` in ``/generate`` held the server's main process at 4.5 GB for a minute before its 400,
and the bodies the server takes (``--max-request-body-bytes``, sized for a few large ``data:``
images) hold several times that. No token is shorter than a character and few are longer than
16, so a prompt of more than 16 characters per token of the context cannot fit: it gets its 400
at once, before any tokenizer runs (``/generate``'s ``text``, the OpenAI routes' ``messages``
and ``prompt``). A batch of prompts is bounded in all too (``MAX_BATCH_CHARS``, or one prompt's
bound where that is larger): tokenizing takes some 200 bytes of memory per character.
"""

from __future__ import annotations

from typing import Any

MAX_CHARS_PER_TOKEN = 16
MAX_BATCH_CHARS = 1 << 22  # 4 Mi characters: ~1 GB while they are tokenized


def prompt_chars(request: Any) -> list[int]:
    """Characters of text of each prompt a request asks the tokenizer to read (images and ids
    not counted): one per item of a batch, the whole conversation of a chat as one."""
    counts = []
    for name in ("text", "prompt"):
        value = getattr(request, name, None)
        counts += [_text_chars(item) for item in value] if isinstance(value, list) else [_text_chars(value)]
    messages = getattr(request, "messages", None) or []
    counts.append(sum(_text_chars(m.get("content") if isinstance(m, dict) else getattr(m, "content", None))
                      for m in messages))
    return counts


def _text_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_text_chars(item) for item in value)
    if isinstance(value, dict):  # a content part: {"type": "text", "text": ...}
        return _text_chars(value.get("text"))
    text = getattr(value, "text", None)  # a content part as a pydantic model
    return len(text) if isinstance(text, str) else 0


def too_long(request: Any, context_tokens: int) -> str | None:
    """Why ``request``'s prompts cannot fit ``context_tokens``, or None."""
    counts = prompt_chars(request)
    limit = context_tokens * MAX_CHARS_PER_TOKEN
    if max(counts) > limit:
        return (f"a prompt of {max(counts)} characters cannot fit the model's context of {context_tokens} tokens "
                f"(refused before tokenizing above {limit} characters, {MAX_CHARS_PER_TOKEN} per token)")
    if sum(counts) > max(limit, MAX_BATCH_CHARS):
        return (f"the request's prompts hold {sum(counts)} characters, over the {max(limit, MAX_BATCH_CHARS)} "
                f"one request may have tokenized")
    return None
