"""Which recipe keys each rule reads, found in the rules' source with `ast` (no hand-kept list to fall out of date).

A rule is a statement that reports a problem: `out.append(("dotted.key", message))` in recipe/rules.py (the key it
names is the one the user should change), or `raise ValueError(message)` in a section's model validator in
schema.py (pydantic reports it at the section). The keys a rule reads are those of every attribute path in the
conditions (`if`, `elif`, `for`) around it and in its message, followed through local names (`m, p = r.model,
r.parallelism`; `need = lc.think_budget_max + ...`) and through the sections' properties and methods (`m.is_moe`
reads `model.num_experts`; `p.dp_size(...)` reads `parallelism.dp`, `tp`, `pp`). Parameters are typed by their
annotation (`m: ModelConfig`), `self` by its class. What the code reaches through another object (a model family's
own checks, `getattr`) is not seen.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from megatron_scalerl.recipe import rules as rules_module
from megatron_scalerl.recipe import schema as schema_module

if TYPE_CHECKING:
    from megatron_scalerl.recipe.explain import Key

PACKAGE = Path(schema_module.__file__).resolve().parents[1]  # megatron_scalerl/


@dataclass(frozen=True)
class Rule:
    """One rule: `where` (file:line) and `function` it sits in, `target` the key it names, `message` its text with
    `{...}` where values go, `reads` the keys whose values decide it or appear in its message."""

    where: str
    function: str
    target: str
    message: str
    reads: frozenset[str]

    def involves(self, key: str) -> bool:
        """Whether the rule names `key` or reads it (a section: any key inside it)."""
        return any(k == key or k.startswith((key + ".", key + "[]")) for k in (self.target, *self.reads))

    def summary(self) -> str:
        return f"{self.where} {self.function}: {self.target}: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return {"where": self.where, "function": self.function, "target": self.target, "message": self.message,
                "reads": sorted(self.reads)}


@dataclass(frozen=True)
class _At:
    """A local name that stands for a section of the recipe: its dotted path and class (a variant section's: its
    alternatives)."""

    path: str
    classes: tuple[type[BaseModel], ...]


def _chain(node: ast.AST) -> tuple[str, list[str]] | None:
    """`r.model.num_layers` -> ('r', ['model', 'num_layers']); None when it does not start at a name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def _message(node: ast.AST | None) -> str:
    """A message's text, `{expression}` where an f-string puts a value."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else f"{{{ast.unparse(v.value)}}}" for v in node.values)
    text = ast.unparse(node) if node is not None else ""
    return f"{{{text[:60]}{'...' if len(text) > 60 else ''}}}"


@cache
def _source(obj: Any) -> tuple[ast.Module, int, str]:
    """(parsed source, its first line's number in its file, the file relative to the package) of a module or
    class."""
    lines, first = inspect.getsourcelines(obj)
    where = Path(inspect.getsourcefile(obj)).resolve().relative_to(PACKAGE).as_posix()
    return ast.parse(textwrap.dedent("".join(lines))), max(first, 1), where


class _Reader:
    """Reads rules out of functions; `keys` is explain.schema_keys()'s map of the recipe's keys."""

    def __init__(self, keys: dict[str, Key]):
        self.keys = keys
        self.members: dict[tuple[type, str, str], frozenset[str]] = {}

    def follow(self, chain: tuple[str, list[str]], env: dict[str, Any]) -> _At | frozenset[str]:
        """What a name's attribute path stands for: a section, or the keys reading it reads."""
        root, attrs = chain
        found = env.get(root, frozenset())
        for attr in attrs:
            if not isinstance(found, _At):
                return found
            key = self.keys.get(f"{found.path}.{attr}" if found.path else attr)
            if key is not None:
                if key.section is None or key.listed:
                    return frozenset({key.path})
                found = _At(key.path, key.variants or (key.section,))
            else:
                return self.member(found, attr)
        return found

    def member(self, at: _At, name: str) -> frozenset[str]:
        """The keys a section's property or method reads (`self.x` and the members it calls in turn)."""
        cache_key = (at.classes, name, at.path)
        if cache_key not in self.members:
            self.members[cache_key] = frozenset()  # a member that reaches itself reads nothing more
            fn = next((node for cls in (c for held in at.classes for c in held.__mro__)
                       if _ours(cls)
                       for node in ast.walk(_source(cls)[0])
                       if isinstance(node, ast.FunctionDef) and node.name == name), None)
            self.members[cache_key] = self.reads(fn, {"self": at}) if fn else frozenset()
        return self.members[cache_key]

    def reads(self, node: ast.AST, env: dict[str, Any]) -> frozenset[str]:
        """Every key `node` reads."""
        if isinstance(node, ast.Attribute | ast.Name) and (chain := _chain(node)):
            found = self.follow(chain, env)
            return found if isinstance(found, frozenset) else frozenset()
        out: set[str] = set()
        for child in ast.iter_child_nodes(node):
            out |= self.reads(child, env)
        return frozenset(out)

    def bind(self, target: ast.AST, value: ast.AST, env: dict[str, Any]) -> None:
        """Record what the names an assignment binds stand for."""
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts, strict=True):
                self.bind(t, v, env)
        elif isinstance(target, ast.Name) and (chain := _chain(value)):
            env[target.id] = self.follow(chain, env)
        else:
            for name in (n for n in ast.walk(target) if isinstance(n, ast.Name)):
                env[name.id] = self.reads(value, env)

    def walk(self, body: list[ast.stmt], env: dict[str, Any], conditions: list[ast.AST],
             section: str | None) -> Iterator[tuple[ast.stmt, str, ast.AST | None, frozenset[str]]]:
        """(statement, target key, message, keys read) of every rule in `body`; `section`: the path a validator's
        `raise ValueError` reports at (None outside validators)."""
        for st in body:
            if isinstance(st, ast.Assign | ast.AnnAssign) and st.value is not None:
                for target in st.targets if isinstance(st, ast.Assign) else [st.target]:
                    self.bind(target, st.value, env)
            elif isinstance(st, ast.If):
                yield from self.walk(st.body, env, [*conditions, st.test], section)
                yield from self.walk(st.orelse, env, [*conditions, st.test], section)
            elif isinstance(st, ast.For):  # each loop name may stand for anything the loop runs over
                env.update({n.id: self.reads(st.iter, env) for n in ast.walk(st.target) if isinstance(n, ast.Name)})
                yield from self.walk(st.body, env, [*conditions, st.iter], section)
            elif isinstance(st, ast.Expr) and (rule := _appended(st.value)):
                yield st, rule[0], rule[1], self._decided(conditions, rule[1], env)
            elif isinstance(st, ast.Raise) and section is not None and _is_value_error(st.exc):
                message = st.exc.args[0] if st.exc.args else None
                yield st, section, message, self._decided(conditions, message, env)

    def _decided(self, conditions: list[ast.AST], message: ast.AST | None, env: dict[str, Any]) -> frozenset[str]:
        out = frozenset().union(*(self.reads(c, env) for c in conditions))
        return out | (self.reads(message, env) if message is not None else frozenset())

    def rules(self, fn: ast.FunctionDef, env: dict[str, Any], first: int, where: str,
              section: str | None = None) -> Iterator[Rule]:
        for st, target, message, reads in self.walk(fn.body, env, [], section):
            yield Rule(f"{where}:{first + st.lineno - 1}", fn.name, target, _message(message), reads)


def _appended(node: ast.AST) -> tuple[str, ast.AST] | None:
    """(key, message) of `out.append(("key", message))`."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
            and len(node.args) == 1 and isinstance(node.args[0], ast.Tuple) and len(node.args[0].elts) == 2
            and isinstance(node.args[0].elts[0], ast.Constant) and isinstance(node.args[0].elts[0].value, str)):
        return node.args[0].elts[0].value, node.args[0].elts[1]
    return None


def _is_value_error(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ValueError"


def _ours(cls: type) -> bool:
    """Whether a section class is written in this package (the recipe's, a family's), not pydantic's."""
    return cls.__module__.startswith(f"{PACKAGE.name}.")


def _is_validator(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Call) and getattr(d.func, "id", None) == "model_validator" for d in fn.decorator_list)


def rules_of(keys: dict[str, Key], model: type[BaseModel], module: ModuleType = rules_module) -> list[Rule]:
    """Every rule of `module`'s functions (their parameters typed by section class names: `m: ModelConfig`), then of
    the model validators of `model`'s sections, each with the keys it reads."""
    reader = _Reader(keys)
    places = {model: [""]}  # section class -> the paths it sits at
    for key in keys.values():
        for cls in key.variants or ((key.section,) if key.section is not None else ()):
            places.setdefault(cls, []).append(key.inner)
    by_name = {cls.__name__: (cls, paths[0]) for cls, paths in places.items()}
    out: list[Rule] = []
    tree, first, where = _source(module)
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        env = {a.arg: _At(by_name[a.annotation.id][1], (by_name[a.annotation.id][0],)) for a in fn.args.args
               if isinstance(a.annotation, ast.Name) and a.annotation.id in by_name}
        out += reader.rules(fn, env, first, where)
    validated: dict[type[BaseModel], list[str]] = {}  # each class whose validators a section runs (its bases too)
    for cls, paths in places.items():
        for base in (c for c in cls.__mro__ if _ours(c)):
            validated.setdefault(base, []).extend(p for p in paths if p not in validated.get(base, []))
    for cls, paths in validated.items():
        tree, first, where = _source(cls)
        for fn in (n for n in tree.body[0].body if isinstance(n, ast.FunctionDef) and _is_validator(n)):
            for path in paths:
                out += reader.rules(fn, {"self": _At(path, (cls,))}, first, where, section=path or "(recipe)")
    return out
