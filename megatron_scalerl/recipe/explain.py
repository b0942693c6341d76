"""What a recipe key means, from the code itself: pure functions over the schema, the rules and the presets.

    schema_keys()          every key of the recipe, sections and values, dotted from the top (`[]` marks a list's
                           items: `data.train[].kind`), with its one-line description, type and schema default
    recipe_rules()         the cross-field rules (recipe/rules.py) and the sections' own validators (schema.py),
                           each with the keys it reads, found in their source with `ast` (rule_reads.py)
    explain_key(key, ...)  a key's description, type, default (and the file and comment it comes from), the presets
                           that change it and the rules that involve it: `scalerl recipe explain KEY`
    annotate_yaml(text)    every key line of a recipe's YAML with its description: `scalerl recipe show --explain`
    unknown_key_hint(loc)  "; did you mean ..." for a key the schema does not know (difflib over the known keys)
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from megatron_scalerl.errors import RecipeError
from megatron_scalerl.fileio import parse_yaml
from megatron_scalerl.recipe.rule_reads import Rule, rules_of
from megatron_scalerl.recipe.schema import Recipe
from megatron_scalerl.recipe.variants import Variant, union_variants

REQUIRED = "required"  # the default of a key the schema gives none (every recipe sets it)
OWN_NAME = "name"  # the key every preset sets to its own name: not compared across presets


@dataclass(frozen=True)
class Key:
    """One recipe key. `section`: the section class it holds (its keys are `path.<field>`, or `path[].<field>` when
    `listed`: a list of them), None for a plain value. `default`: the schema's, REQUIRED when it has none.
    `variants`: a variant section's alternatives (recipe/variants.py; `section` is the first), else empty."""

    path: str
    description: str
    type_text: str
    default: Any
    section: type[BaseModel] | None = None
    listed: bool = False
    variants: tuple[type[Variant], ...] = ()

    @property
    def inner(self) -> str:
        """The prefix of the keys inside it: `path`, or `path[]` for a list of sections."""
        return f"{self.path}[]" if self.listed else self.path


def _sections(annotation: Any, listed: bool = False) -> Iterator[tuple[type[BaseModel], bool]]:
    """The section classes an annotation holds (through Optional, unions and Annotated), each with whether a list
    holds it; a free-form mapping (`dict`) holds none."""
    origin = get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, listed
    elif origin is not dict:
        for arg in get_args(annotation):
            yield from _sections(arg, listed or origin is list)


def _constraints(metadata: Iterable[Any]) -> list[str]:
    """`> 0`, `in [0, 1]`, `at least 1 item` for the bounds in a field's metadata (pydantic's and annotated_types')."""
    bounds: dict[str, Any] = {}
    out = []
    for item in metadata:
        for c in item.metadata if isinstance(item, FieldInfo) else [item]:
            bounds.update({name: getattr(c, name) for name in ("gt", "ge", "lt", "le")
                           if getattr(c, name, None) is not None})
            if getattr(c, "min_length", None) is not None:
                out.append(f"at least {c.min_length} item{'s' if c.min_length > 1 else ''}")
    low = [("(" if name == "gt" else "[", value) for name, value in bounds.items() if name in ("gt", "ge")]
    high = [(")" if name == "lt" else "]", value) for name, value in bounds.items() if name in ("lt", "le")]
    if low and high:
        return [f"in {low[0][0]}{low[0][1]}, {high[0][1]}{high[0][0]}", *out]
    signs = {"(": ">", "[": ">=", ")": "<", "]": "<="}
    return [f"{signs[bracket]} {value}" for bracket, value in low + high] + out


def type_text(annotation: Any, metadata: Iterable[Any] = ()) -> str:
    """A field's type in words: `int > 0`, `one of cispo, ppo_clip`, `float > 0 or null`, `list of DataSource`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        text = type_text(args[0], args[1:])
    elif origin is Literal:
        text = "one of " + ", ".join(map(str, args))
    elif origin in (Union, types.UnionType):
        text = " | ".join(type_text(a) for a in args if a is not type(None))
        text += " or null" if type(None) in args else ""
    elif origin is list:
        text = f"list of {type_text(args[0])}"
    elif origin is dict:
        text = f"mapping of {type_text(args[0])} to {type_text(args[1])}"
    else:
        text = getattr(annotation, "__name__", str(annotation))
    bounds = _constraints(metadata)
    return f"{text} {', '.join(bounds)}" if bounds else text


@cache
def schema_keys(model: type[BaseModel] = Recipe) -> dict[str, Key]:
    """Every key of `model`, sections before their keys, in the schema's order."""
    out: dict[str, Key] = {}

    def walk(cls: type[BaseModel], prefix: str) -> None:
        for name, info in cls.model_fields.items():
            path = f"{prefix}.{name}" if prefix else name
            default = REQUIRED if info.is_required() else info.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                default = default.model_dump(mode="json")
            held = next(_sections(info.annotation), None)
            variants = union_variants(info.annotation)
            text = (" | ".join(tag for v in variants for tag in v.tags()) if variants
                    else type_text(info.annotation, info.metadata))
            key = Key(path, info.description or "", text, default, *(held or (None, False)), variants=variants)
            if path in out and name == getattr(cls, "tag_key", None):  # an alternative's tag: one key for them all
                first = out[path]
                out[path] = replace(first, description=f"{first.description}; {key.description}",
                                    type_text=f"{first.type_text}, {key.type_text.removeprefix('one of ')}",
                                    default=REQUIRED)
            out.setdefault(path, key)  # a field two alternatives share (eps_max) is described once
            for inner in variants or ([held[0]] if held else []):
                walk(inner, key.inner)

    walk(model, "")
    return out


def variant_tags(path: str) -> set[str]:
    """The tags of the alternatives of the variant section at `path` (empty for any other key)."""
    key = schema_keys().get(path)
    return {tag for cls in key.variants for tag in cls.tags()} if key else set()


def variant_tag_key(path: str) -> str | None:
    """The tag field of the variant section at `path` (`type`, `mode`), None for any other key."""
    key = schema_keys().get(path)
    return key.variants[0].tag_key if key and key.variants else None


@cache
def recipe_rules(model: type[BaseModel] = Recipe) -> tuple[Rule, ...]:
    """The rules of recipe/rules.py and the model validators of the sections in `model` (rule_reads.rules_of)."""
    return tuple(rules_of(schema_keys(model), model))


def find_key(name: str, keys: dict[str, Key]) -> Key:
    """The key `name` stands for (`data.train.kind`, `data.train[0].kind` and `data.train[].kind` are one key);
    RecipeError with the nearest known keys otherwise."""
    if name in keys:
        return keys[name]
    bare = {re.sub(r"\[\d*\]", "", k): k for k in keys}
    plain = re.sub(r"\[\d*\]", "", name)
    if plain in bare:
        return keys[bare[plain]]
    near = nearest_keys(name, keys)
    raise RecipeError(name, "unknown key" + (f"; did you mean {', '.join(near)}?" if near else ""))


def values_at(data: Any, path: str) -> list[Any]:
    """Every value `path` holds in a recipe mapping: one for a plain key, one per list item under `[]`, none when
    absent."""
    nodes = [data]
    for part in path.split("."):
        name = part.removesuffix("[]")
        nodes = [node[name] for node in nodes if isinstance(node, dict) and name in node]
        if part.endswith("[]"):
            nodes = [item for node in nodes if isinstance(node, list) for item in node]
    return nodes


def _shown(values: list[Any]) -> Any:
    """values_at's values as shown: the value of a plain key, the list of a list's items (empty: absent)."""
    return values[0] if len(values) == 1 else values


@dataclass(frozen=True)
class Presets:
    """What explain compares a key across, each preset a recipe mapping with the schema's defaults filled in (the
    loader's `preset_catalogue` builds it): `base` the default recipe `base_name`; `runs` every run preset by name
    (the base's own entry is not compared); `models` the base with each model preset (`--model NAME`). `files`: (label, YAML text) of the files the
    base is made of, the one that wins first (scalerl.yaml, then its model preset): which file sets a key, and the
    comment beside it."""

    base_name: str
    base: dict[str, Any]
    runs: dict[str, dict[str, Any]]
    models: dict[str, dict[str, Any]]
    files: list[tuple[str, str]] = field(default_factory=list)


def yaml_key_lines(text: str) -> list[tuple[str | None, str]]:
    """(dotted key the line sets, line) for every line of a block-style YAML mapping; None for lines that set no key
    (comments, blank lines, list items that are plain values, continued values). A list item's keys are
    `parent[].key`."""
    out: list[tuple[str | None, str]] = []
    stack: list[tuple[float, str]] = []  # (column, path) of the open keys and list items, innermost last
    for line in text.splitlines():
        body = line.lstrip()
        column = len(line) - len(body)
        if body.startswith("- "):
            while stack and stack[-1][0] > column:
                stack.pop()
            if not stack:
                out.append((None, line))
                continue
            stack.append((column + 0.5, f"{stack[-1][1]}[]"))  # the item: its keys sit two columns in
            body, column = body[2:].lstrip(), column + 2
        match = re.match(r"([A-Za-z0-9_]+):(\s|$)", body)
        if not match or body.startswith("#"):
            out.append((None, line))
            continue
        while stack and stack[-1][0] >= column:
            stack.pop()
        path = f"{stack[-1][1]}.{match.group(1)}" if stack else match.group(1)
        stack.append((column, path))
        out.append((path, line))
    return out


def _comment(line: str) -> str:
    """The comment at the end of a YAML line ('' when none), `#` inside quotes not counted."""
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[i + 1:].strip()
    return ""


def yaml_comments(text: str) -> dict[str, str]:
    """{dotted key: the comment on its line, and on the comment-only lines that continue it}."""
    out: dict[str, str] = {}
    last = None
    for path, line in yaml_key_lines(text):
        if path is not None:
            last = path
            out[path] = _comment(line)
        elif last and line.strip().startswith("#") and out.get(last):
            out[last] += " " + _comment(line)
        else:
            last = None
    return out


def annotate_yaml(text: str, keys: dict[str, Key] | None = None) -> str:
    """`text` with `# description` after every line that sets a key of the schema (the comments aligned)."""
    keys = schema_keys() if keys is None else keys
    lines = yaml_key_lines(text)
    width = min(max((len(line) for path, line in lines if path in keys), default=0), 60)
    return "".join(f"{line:<{width}}  # {_line_description(path, line, keys)}\n" if path in keys else line + "\n"
                   for path, line in lines)


def _line_description(path: str, line: str, keys: dict[str, Key]) -> str:
    """The description of the key a YAML line sets; a variant section's tag: its chosen alternative's."""
    section = keys.get(path.rpartition(".")[0])
    if section is not None and section.variants and path.endswith("." + section.variants[0].tag_key):
        chosen = line.partition(":")[2].partition("#")[0].strip().strip("'\"")
        for cls in section.variants:
            if chosen in cls.tags():
                return cls.model_fields[cls.tag_key].description
    return keys[path].description


@dataclass(frozen=True)
class Explanation:
    """One key explained (`scalerl recipe explain KEY`): `default` the base's value (list items: one per item),
    `origin` where it comes from; `presets` / `models`: (name, value) of the run presets and model presets that
    give it another value; `rules` the rules that read it or name it; `inside` the keys of a section."""

    key: Key
    default: Any
    origin: str
    presets: list[tuple[str, Any]]
    models: list[tuple[str, Any]]
    rules: list[Rule]
    inside: list[Key]

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key.path, "description": self.key.description, "type": self.key.type_text,
                "default": self.default, "default_from": self.origin, "presets": dict(self.presets),
                "model_presets": dict(self.models), "rules": [r.as_dict() for r in self.rules],
                "keys": [k.path for k in self.inside]}

    def text(self) -> str:
        section = self.key.section is not None

        def changed(rows: list[tuple[str, Any]]) -> str:
            if not rows:
                return "none"
            return ", ".join(name if section else f"{name} {value!r}" for name, value in rows)

        out = [f"{self.key.path}: {self.key.description}", f"  type     {self.key.type_text}"]
        if not section:
            out.append(f"  default  {self.default!r}  ({self.origin})")
        out += [f"  presets  {changed(self.presets)}", f"  models   {changed(self.models)}"]
        out += [f"  {'rules' if i == 0 else '':<7}  {rule.summary()}" for i, rule in enumerate(self.rules)]
        if not self.rules:
            out.append("  rules    none")
        out += [f"    {k.path:<44} {k.description}" for k in self.inside]
        return "\n".join(out)


@cache
def _read_file(label: str, text: str) -> tuple[Any, dict[str, str]]:
    """(its mapping, its comments by key) of a preset file."""
    return parse_yaml(text, label), yaml_comments(text)


def _origin(key: Key, presets: Presets) -> str:
    """Which file of the base sets the key, with its comment; else the schema's default."""
    for label, text in presets.files:
        data, comments = _read_file(label, text)
        if values_at(data, key.path):
            return f"{label}: {comments[key.path]}" if comments.get(key.path) else label
    return "the schema's default" if key.default is not REQUIRED else "set by the loader"


def explain_key(name: str, presets: Presets, keys: dict[str, Key] | None = None,
            rules: Iterable[Rule] | None = None) -> Explanation:
    """Explain key `name` (RecipeError naming the nearest keys when the schema has no such key)."""
    keys = schema_keys() if keys is None else keys
    rules = recipe_rules() if rules is None else rules
    key = find_key(name, keys)
    base = values_at(presets.base, key.path)

    def changes(recipes: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
        if key.path == OWN_NAME:
            return []
        return [(n, _shown(values_at(r, key.path))) for n, r in sorted(recipes.items())
                if n != presets.base_name and values_at(r, key.path) != base]

    inside = [k for p, k in keys.items() if p.rpartition(".")[0] == key.inner] if key.section else []
    return Explanation(key, _shown(base), _origin(key, presets), changes(presets.runs), changes(presets.models),
                       [r for r in rules if r.involves(key.path)], inside)


def key_table(presets: Presets, keys: dict[str, Key] | None = None) -> str:
    """Every key on one line: its path, its default in the base recipe and its description (`recipe explain`)."""
    keys = schema_keys() if keys is None else keys
    rows = [(k.path, "" if k.section else repr(_shown(values_at(presets.base, k.path))), k.description)
            for k in keys.values()]
    width = max(len(p) for p, _, _ in rows)
    return "\n".join(f"{p:<{width}}  {d[:24]:<24}  {text}" for p, d, text in rows)


def nearest_keys(unknown: str, known: Iterable[str], n: int = 3) -> list[str]:
    """Up to `n` known dotted keys nearest to `unknown` (difflib), the first kind that finds any: its siblings spelled
    alike; keys of (nearly) the same name in other sections; the nearest whole paths."""
    known = list(known)
    parent, _, last = unknown.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    named: dict[str, list[str]] = {}
    for k in known:
        named.setdefault(k.rpartition(".")[2], []).append(k)
    found = ([siblings[m] for m in difflib.get_close_matches(last, siblings, n, 0.6)]
             or [k for m in difflib.get_close_matches(last, named, n, 0.8) for k in named[m]]
             or difflib.get_close_matches(unknown, known, n, 0.6))
    return found[:n]


def unknown_key_hint(loc: tuple[str | int, ...], value: Any = None, keys: dict[str, Key] | None = None) -> str:
    """'; did you mean a, b?' for the unknown key at pydantic error location `loc` (its value `value`: a mapping's
    own keys are tried under the nearest sections too), '' when nothing is near. Parts of `loc` that name no key
    (a union member's tag, a validator) are skipped; list indices are kept in the suggestions."""
    keys = schema_keys() if keys is None else keys
    path = shown = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path, shown = f"{path}[]", f"{shown}[{part}]"
        elif i == len(loc) - 1 or (f"{path}.{part}" if path else str(part)) in keys:
            path, shown = (f"{path}.{part}" if path else str(part)), (f"{shown}.{part}" if shown else str(part))
    tries = [f"{path}.{k}" for k in value] if isinstance(value, dict) else []
    near = list(dict.fromkeys(k for t in [*tries, path] for k in nearest_keys(t, keys)))[:3]
    parent, shown_parent = path.rpartition(".")[0], shown.rpartition(".")[0]
    near = [shown_parent + k[len(parent):] if parent and k.startswith(parent + ".") else k for k in near]
    return f"; did you mean {', '.join(near)}?" if near else ""
