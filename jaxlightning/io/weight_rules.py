"""Rename rules between weight names in a file and paths in a variables tree.

A rule is ``(source, target)`` or ``(source, target, layout)``:

- ``source`` is a name template, ``"model.layers.{i}.mlp.up_proj.weight"``: each
  ``{field}`` matches one dot- or slash-free part of a name;
- ``target`` is a tree path template, ``"params/layers_{i}/mlp/up/kernel"``,
  filled with the same fields, optionally ending in an index that places the
  source in part of the target: ``[{i}]`` (one slice of a stacked array),
  ``[:, 0:64]`` (a column block of a fused one); ``None`` drops the name;
- ``layout`` is how the source's axes become the target's: ``"T"`` reverses
  them (a PyTorch ``Linear`` weight is the transpose of a flax ``Dense``
  kernel), a tuple is a permutation as ``numpy.transpose`` takes it.

Templates read both ways, so one list of rules loads a file and writes it back.
A function ``name -> target`` (a string as above, ``(target, layout)`` or
``None``) may replace the list when loading; writing then takes a function
``path -> name``. Without rules a name's dots are the path's slashes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

Layout = str | tuple[int, ...] | None
Rules = Sequence[tuple[Any, ...]] | Callable[[str], Any] | None

_FIELD = re.compile(r"\{(\w+)\}")
_INDEXED = re.compile(r"(?P<path>[^\[]*)\[(?P<index>[^\]]*)\]")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one named array goes: the leaf at ``path``, the part ``index``
    selects (empty: all of it), its axes permuted by ``layout`` first."""

    path: str
    index: tuple[int | slice, ...] = ()
    layout: Layout = None

    def permutation(self, ndim: int) -> tuple[int, ...] | None:
        """The source axes in target order (``None``: as they are)."""
        if self.layout is None:
            return None
        if self.layout == "T":
            return tuple(reversed(range(ndim)))
        perm = tuple(self.layout)
        if sorted(perm) != list(range(ndim)):
            raise ValueError(
                f"layout {self.layout!r} for {self.path} is not a permutation of the "
                f"{ndim} axes of its source; give 'T' or a tuple of 0..{ndim - 1}"
            )
        return perm


def _template(text: str) -> re.Pattern[str]:
    parts = _FIELD.split(text)
    pattern = "".join(
        f"(?P<{part}>[^./\\[\\]]+)" if i % 2 else re.escape(part) for i, part in enumerate(parts)
    )
    return re.compile(pattern)


def _parse_index(text: str, where: str) -> tuple[int | slice, ...]:
    index: list[int | slice] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            if ":" in part:
                start, stop = (int(x) if x.strip() else None for x in part.split(":"))
                index.append(slice(start, stop))
            else:
                index.append(int(part))
        except ValueError:
            raise ValueError(
                f"index [{text}] in {where!r}: each part is an integer, ':' or 'a:b'"
            ) from None
    return tuple(index)


def placement(target: str, layout: Layout = None) -> Placement:
    """A filled target string (``path`` or ``path[index]``) as a `Placement`."""
    found = _INDEXED.fullmatch(target)
    if found is None:
        return Placement(target, (), layout)
    return Placement(found["path"], _parse_index(found["index"], target), layout)


def _checked_rule(rule: Any) -> tuple[str, str | None, Layout]:
    if not isinstance(rule, tuple) or len(rule) not in (2, 3) or not isinstance(rule[0], str):
        raise TypeError(
            f"a rename rule is (source, target) or (source, target, layout), got {rule!r}; "
            "e.g. ('model.layers.{i}.mlp.up_proj.weight', 'params/layers_{i}/up/kernel', 'T')"
        )
    source, target = rule[0], rule[1]
    if target is not None and set(_FIELD.findall(target)) - set(_FIELD.findall(source)):
        raise ValueError(f"rule {rule!r}: the target uses a field the source does not name")
    return source, target, rule[2] if len(rule) == 3 else None


def source_to_target(rules: Rules) -> Callable[[str], Placement | None | bool]:
    """``name -> Placement`` from ``rules``; ``None`` for a name a rule drops,
    ``False`` for one no rule matches."""
    if rules is None:
        return lambda name: placement(name.replace(".", "/"))
    if callable(rules):

        def by_function(name: str) -> Placement | None | bool:
            out = rules(name)
            if out is None:
                return None
            target, layout = out if isinstance(out, tuple) else (out, None)
            return placement(target, layout)

        return by_function
    compiled = [(_template(s), t, layout) for s, t, layout in map(_checked_rule, rules)]

    def by_rules(name: str) -> Placement | None | bool:
        for pattern, target, layout in compiled:
            found = pattern.fullmatch(name)
            if found:
                return (
                    None
                    if target is None
                    else placement(target.format(**found.groupdict()), layout)
                )
        return False

    return by_rules


def target_to_sources(
    rules: Rules,
) -> Callable[[str, tuple[int, ...]], Iterator[tuple[str, Placement]]]:
    """``(path, shape) -> (name, Placement)`` pairs: the inverse of the rules,
    for writing a tree. A template with an index field (``[{i}]``) yields one
    name per position along that axis."""
    if rules is None:
        return lambda path, shape: iter([(path.replace("/", "."), Placement(path))])
    if callable(rules):
        return lambda path, shape: iter([(rules(path), Placement(path))])
    compiled = []
    for source, target, layout in map(_checked_rule, rules):
        if target is None:
            continue
        found = _INDEXED.fullmatch(target)
        path_part, index_part = (found["path"], found["index"]) if found else (target, None)
        compiled.append((source, _template(path_part), index_part, layout))

    def inverse(path: str, shape: tuple[int, ...]) -> Iterator[tuple[str, Placement]]:
        # The first rule that writes the whole leaf; else every rule writing a
        # part of it (a fused array is written back as its pieces).
        parts = False
        for source, pattern, index_part, layout in compiled:
            found = pattern.fullmatch(path)
            if not found or (parts and index_part is None):
                continue
            for fields in _index_fields(index_part, found.groupdict(), shape):
                index = index_part.format(**fields) if index_part is not None else None
                target = path if index is None else f"{path}[{index}]"
                yield source.format(**fields), placement(target, layout)
            if index_part is None:
                return
            parts = True

    return inverse


def _index_fields(index: str | None, fields: dict[str, str], shape: tuple[int, ...]):
    """Every filling of the index's own fields: each runs along its axis."""
    if index is None:
        return [fields]
    free = [
        (dim, name[1:-1])
        for dim, name in enumerate(p.strip() for p in index.split(","))
        if _FIELD.fullmatch(name) and name[1:-1] not in fields
    ]
    fillings = [dict(fields)]
    for dim, name in free:
        fillings = [{**f, name: str(i)} for f in fillings for i in range(shape[dim])]
    return fillings
