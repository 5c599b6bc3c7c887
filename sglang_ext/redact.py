"""Secrets out of everything SGLang shows: ``/server_info``, ``/get_server_info``, its logs, its dumps.

SGLang reports its resolved configuration (``ServerArgs.resolved_dict``) and the command line it
was started with (``launch_command``) on open routes and in its start-up log; it hides only its
watermark keys. The plugin hooks ``resolved_dict`` in every SGLang process (the scheduler reports
its own copy in ``internal_states``) to hide the API keys and SSL password too, and writes the
command line of our modes without the values of secret flags, ours included.
"""

from __future__ import annotations

from collections.abc import Iterable

REDACTED = "<redacted>"
# ServerArgs fields whose values are secrets
SECRET_FIELDS = frozenset({"api_key", "admin_api_key", "ssl_keyfile_password", "control_secret"})
SECRET_FLAGS = frozenset("--" + name.replace("_", "-") for name in SECRET_FIELDS)


def redact_fields(resolved: dict) -> dict:
    """``resolved`` with each secret field that is set replaced by ``<redacted>``."""
    return {key: REDACTED if key in SECRET_FIELDS and value else value for key, value in resolved.items()}


def redact_command_line(command: str | Iterable[str] | None) -> str | None:
    """A command line (a string of space-separated words, or argv) without the values of secret
    flags, given as ``--flag value`` or ``--flag=value``."""
    if command is None:
        return None
    words = command.split(" ") if isinstance(command, str) else list(command)
    out: list[str] = []
    hide_next = False
    for word in words:
        name, eq, _ = word.partition("=")
        if hide_next:
            out.append(REDACTED)
        elif eq and name in SECRET_FLAGS:
            out.append(f"{name}={REDACTED}")
        else:
            out.append(word)
        hide_next = not eq and word in SECRET_FLAGS
    return " ".join(out)
