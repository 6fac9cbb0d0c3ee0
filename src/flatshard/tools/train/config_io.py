"""Reading, overriding and writing :class:`~flatshard.tools.train.config.TrainConfig` as TOML.

* :func:`from_dict` builds a config from nested dicts (a parsed TOML file); an unknown section or
  key is a ``ValueError`` that lists the valid ones, a value of the wrong type a ``TypeError``.
* :func:`apply_overrides` applies ``("optim.lr", "1e-3")`` pairs from the command line, converting
  each string to its field's type. A section may be named by an alias (``SECTION_ALIASES``:
  ``parallelism`` for ``parallel``), in a file as on the command line.
* :func:`to_toml` writes the config back, every field with its docstring as a comment, so that
  ``--config OUT/config.toml`` reproduces a run and documents it. Each ``key = value`` line is
  ``tomli_w``'s (quoting, escapes, inf/nan); the comments around them are ours, as no TOML writer
  writes comments.

Parsing (``tomllib``, ``tomli`` on Python 3.10) and writing (``tomli-w``) come with the
``[train]`` extra; the library (``import flatshard``) needs neither.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import typing
from pathlib import Path
from typing import Any

from flatshard.tools.train.config import SECTION_ALIASES, SECTIONS, TrainConfig

try:
    import tomli_w

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
        import tomli as tomllib  # type: ignore[no-redef]
except ModuleNotFoundError as err:
    raise ModuleNotFoundError(
        f"flatshard train needs {err.name}, from the [train] extra: pip install 'flatshard[train]'"
    ) from err

__all__ = ["apply_overrides", "field_docs", "from_dict", "load_toml", "to_dict", "to_toml"]


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass whose fields carry a string literal below them."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in itertools.pairwise(body):
        is_doc = isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)  # type: ignore[attr-defined]
    return docs


def _types(cls: type) -> dict[str, type]:
    """Field name -> its (scalar or section) type, annotations resolved."""
    return typing.get_type_hints(cls)


def _unknown(kind: str, name: str, valid: list[str]) -> ValueError:
    return ValueError(f"unknown {kind} {name!r}; valid ones: {', '.join(valid)}")


def _check_type(where: str, value: Any, expected: type) -> Any:
    """TOML values arrive typed; accept an int for a float field, nothing else loose."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
        raise TypeError(
            f"{where}={value!r} has type {type(value).__name__}, expected {expected.__name__}"
        )
    return value


def from_dict(raw: dict[str, Any], base: TrainConfig | None = None) -> TrainConfig:
    """A config from ``raw`` (top-level keys and section tables) laid over ``base``."""
    base = base or TrainConfig()
    top_types = _types(TrainConfig)
    top: dict[str, Any] = {}
    for key, value in raw.items():
        key = SECTION_ALIASES.get(key, key)  # [parallelism] is [parallel]
        if key not in top_types:
            valid = [k for k in top_types if k not in SECTIONS] + [f"[{s}]" for s in SECTIONS]
            raise _unknown("top-level key or section", key, valid)
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise TypeError(f"{key} must be a [{key}] table, got {value!r}")
            top[key] = _section(key, value, top.get(key, getattr(base, key)))
        else:
            top[key] = _check_type(key, value, top_types[key])
    return dataclasses.replace(base, **top)


def _section(name: str, raw: dict[str, Any], base: Any) -> Any:
    types = _types(SECTIONS[name])
    values = {}
    for key, value in raw.items():
        if key not in types:
            raise _unknown(f"key in [{name}]", key, [f"{name}.{k}" for k in types])
        values[key] = _check_type(f"{name}.{key}", value, types[key])
    return dataclasses.replace(base, **values)


def load_toml(path: str | Path, base: TrainConfig | None = None) -> TrainConfig:
    """The config in the TOML file ``path`` (missing keys keep ``base``'s values)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: config file not found; check the --config path") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML ({e}); fix the file") from None
    try:
        return from_dict(raw, base)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path}: {e}") from None


def _parse(where: str, text: str, expected: type) -> Any:
    """A command-line string as ``expected`` (bool accepts true/false/1/0/yes/no/on/off)."""
    if expected is str:
        return text
    if expected is bool:
        words = {"true": True, "1": True, "yes": True, "on": True}
        words.update({"false": False, "0": False, "no": False, "off": False})
        if text.lower() in words:
            return words[text.lower()]
        raise ValueError(f"--{where} {text!r}: expected true or false")
    try:
        return expected(text)
    except ValueError:
        raise ValueError(f"--{where} {text!r}: expected {expected.__name__}") from None


def apply_overrides(cfg: TrainConfig, overrides: list[tuple[str, str]]) -> TrainConfig:
    """``cfg`` with each ``("section.key" | "key", string value)`` applied, in order."""
    top_types = _types(TrainConfig)
    for dotted, text in overrides:
        section, _, key = dotted.rpartition(".")
        if section in SECTION_ALIASES:  # --parallelism.tp is --parallel.tp
            section, dotted = SECTION_ALIASES[section], f"{SECTION_ALIASES[section]}.{key}"
        if not section:
            if key not in top_types or key in SECTIONS:
                valid = [k for k in top_types if k not in SECTIONS] + [f"{s}.KEY" for s in SECTIONS]
                raise _unknown("option", f"--{dotted}", valid)
            cfg = dataclasses.replace(cfg, **{key: _parse(key, text, top_types[key])})
            continue
        if section not in SECTIONS:
            raise _unknown("section", f"--{dotted}", list(SECTIONS))
        types = _types(SECTIONS[section])
        if key not in types:
            raise _unknown(f"key in [{section}]", f"--{dotted}", [f"{section}.{k}" for k in types])
        sub = dataclasses.replace(getattr(cfg, section), **{key: _parse(dotted, text, types[key])})
        cfg = dataclasses.replace(cfg, **{section: sub})
    return cfg


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Nested plain dict (top-level scalars, then one dict per section)."""
    return dataclasses.asdict(cfg)


def _toml_line(key: str, value: Any) -> str:
    """``key = value`` as ``tomli_w`` writes it."""
    return tomli_w.dumps({key: value}).rstrip("\n")


def _comment(doc: str) -> list[str]:
    return [f"# {line}".rstrip() for line in doc.splitlines()]


def to_toml(cfg: TrainConfig, header: str = "") -> str:
    """TOML text of ``cfg``; every field is preceded by its docstring as a comment."""
    lines = _comment(header) + ([""] if header else [])
    docs = field_docs(TrainConfig)
    for name, value in to_dict(cfg).items():
        if name not in SECTIONS:
            lines += [*_comment(docs.get(name, "")), _toml_line(name, value)]
    for name, cls in SECTIONS.items():
        lines += ["", f"[{name}]", *_comment(cls.__doc__ or "")]
        section_docs = field_docs(cls)
        for key, value in to_dict(cfg)[name].items():
            lines += [*_comment(section_docs.get(key, "")), _toml_line(key, value)]
    return "\n".join(lines) + "\n"
