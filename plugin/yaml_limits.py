"""Reading a config file's YAML within bounds: nesting depth and the size aliases expand to.

PyYAML's composer recurses once per nesting level (a few thousand `[` raise RecursionError),
and aliases share nodes that a walk of the document (the diff's JSON, the host's copy) expands:
nine levels of ten aliases make 10**9 values from a 100-line file. Both are refused here with
an error naming the file, before anything walks the document."""

from __future__ import annotations

from typing import Any

import yaml

MAX_DEPTH = 64  # a host config nests 4-5 levels; anything near this is not a config
MAX_VALUES = 100_000  # values after alias expansion; a 50-model config has a few thousand


class YamlLimitError(ValueError):
    """The document is too deep or expands too far; the message says where."""


def safe_load(raw: bytes) -> Any:
    """yaml.safe_load, after a depth check on the event stream (the parser is not recursive),
    followed by a size check that counts every value as often as aliases repeat it."""
    depth = 0
    for event in yaml.parse(raw, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise YamlLimitError(f"line {event.start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    doc = yaml.safe_load(raw)
    expanded_size(doc)
    return doc


def expanded_size(doc: Any) -> int:
    """The number of values a full walk of `doc` visits; each shared object is sized once
    (memo by id), so the check itself is linear in the file, not in the expansion."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    # Iterative post-order walk: the depth is bounded already, but a list keeps this obvious.
    stack: list[tuple[Any, bool]] = [(doc, False)]
    while stack:
        node, children_done = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        key = id(node)
        if key in sizes:
            continue
        children = list(node.keys()) + list(node.values()) if isinstance(node, dict) else node
        if not children_done:
            if key in open_:
                raise YamlLimitError("an alias refers to the collection that contains it")
            open_.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in children)
            continue
        open_.discard(key)
        total = 1 + sum(sizes.get(id(c), 1) for c in children)
        if total > MAX_VALUES:
            raise YamlLimitError(f"aliases expand it to more than {MAX_VALUES} values")
        sizes[key] = total
    return sizes.get(id(doc), 1)
