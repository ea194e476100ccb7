"""Chat templates rendered the way transformers' `apply_chat_template` renders them, without transformers.

Same Jinja environment (sandboxed, `trim_blocks`, `lstrip_blocks`, loop controls), the same `tojson` filter and
`raise_exception` global, and the tokenizer's special tokens passed as template variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or failed to render."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)
        self._special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        variables = {"tools": None, "documents": None, **self._special_tokens, **kwargs, "messages": messages,
                     "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(variables)
        except TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
