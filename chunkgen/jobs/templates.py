"""Prompt templates (TOML): a long shared system prompt plus a user message with {placeholders}."""
from __future__ import annotations

import string
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TemplateError(ValueError):
    """A template cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class Template:
    name: str
    path: Path
    system: str
    user: str
    fields: tuple[str, ...]  # placeholders of `user`, in order of first appearance
    sampling: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    def messages(self, values: dict[str, str]) -> list[dict[str, str]]:
        """Chat messages for one query. Values are inserted as plain text: braces inside them are
        never expanded, because only the template string is parsed."""
        user = self.user.format_map({k: values[k] for k in self.fields})
        msgs = [{"role": "user", "content": user}]
        if self.system:
            msgs.insert(0, {"role": "system", "content": self.system})
        return msgs


def _placeholders(text: str, path: Path) -> tuple[str, ...]:
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise TemplateError(f"{path}: field 'user': {exc} (write literal braces as {{{{ and }}}})") from None
    for _, name, spec, conv in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conv:
            raise TemplateError(
                f"{path}: field 'user': placeholder {{{name}{'!' + conv if conv else ''}"
                f"{':' + spec if spec else ''}}} must be a plain name like {{question}}"
            )
        if name not in names:
            names.append(name)
    return tuple(names)


SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop"}


def load_template(path: str | Path) -> Template:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TemplateError(f"{path}: template file not found") from None
    except UnicodeDecodeError as exc:
        raise TemplateError(f"{path}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise TemplateError(f"{path}: not valid TOML: {exc}") from None
    for key in ("system", "user"):
        if key in data and not isinstance(data[key], str):
            raise TemplateError(f"{path}: field '{key}' must be a string")
    if "user" not in data:
        raise TemplateError(f"{path}: missing field 'user' (the per-query message, with {{placeholders}})")
    sampling = data.get("sampling", {})
    if not isinstance(sampling, dict):
        raise TemplateError(f"{path}: [sampling] must be a table")
    unknown = set(sampling) - SAMPLING_KEYS
    if unknown:
        raise TemplateError(f"{path}: [sampling] has unknown keys {sorted(unknown)}; allowed: {sorted(SAMPLING_KEYS)}")
    return Template(
        name=str(data.get("name", path.stem)),
        path=path,
        system=data.get("system", "").strip(),
        user=data["user"],
        fields=_placeholders(data["user"], path),
        sampling=dict(sampling),
        description=str(data.get("description", "")),
    )


def load_templates(path: str | Path) -> dict[str, Template]:
    """One template file, or every *.toml in a directory, keyed by template name."""
    path = Path(path)
    files = sorted(path.glob("*.toml")) if path.is_dir() else [path]
    if not files:
        raise TemplateError(f"{path}: no *.toml templates in this directory")
    templates: dict[str, Template] = {}
    for f in files:
        t = load_template(f)
        if t.name in templates:
            raise TemplateError(f"{f}: template name {t.name!r} is already used by {templates[t.name].path}")
        templates[t.name] = t
    return templates
