"""Render chat messages into a prompt with the model's own Jinja chat template."""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A chat template compiled once in a sandbox, rendered per request.

    Raises ValueError if the template does not compile.
    """

    def __init__(self, template_str: str, bos_token: str | None = None,
                 eos_token: str | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(template_str)
        except jinja2.TemplateError as e:
            raise ValueError(f"invalid chat template: {e}") from e
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.source = template_str

    def takes(self, name: str) -> bool:
        """Whether the template reads a variable or message field of this name (e.g.
        ``tools``, ``tool_calls``): SmolLM2's reads neither."""
        return name in self.source

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text for messages; extra variables (e.g. tools) are passed to the
        template.

        Raises ValueError when the template fails or rejects the messages.
        """
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token,
                                         **variables)
        except Exception as e:
            raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e
