"""The strict compact JSON text of ckrun's manifests, and a mapping rendered once.

:data:`ENCODE` is the manifest encoder: sorted keys, compact separators, no NaN or
infinity (RFC 8259 has none), ASCII.  It is built once: ``json.dumps`` with arguments
builds an encoder on every call.

A :class:`Rendered` mapping carries its own text, encoded when it is made.  The save
plan of a single rank is kept between saves of one structure (:mod:`.plan_memo`), and
with it the manifest layout's global tensors: for a model of 800 tensors their JSON is
3 ms of a 17 ms save (issue 19, small states; bench/README.md, "Eleventh session"), the
same text every save.  :func:`encode_spliced` writes such a mapping's kept text into the
record instead of encoding it again: the same bytes, since this encoder renders a nested
object without regard to where it sits (no indentation) and orders an object's keys by
the keys alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["ENCODE", "Rendered", "encode_spliced"]

#: strict compact JSON text of a value (raises ValueError on NaN or infinity)
ENCODE = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False).encode

_SLOT = "\x00ckrun:rendered\x00"  # stands in for a Rendered value while encoding
_SLOT_TEXT = ENCODE(_SLOT)


class Rendered(dict[str, Any]):
    """A JSON object and its text (:data:`ENCODE`), rendered when it is made.  It must
    not change afterwards (nor the values inside it): nothing in ckrun writes to a
    layout once it is built (it is shared by every manifest of one structure, each a
    frozen dataclass), and ``tests/checkpoint/test_json_text.py`` checks that each
    save's manifest is the text of the whole.  A copy (``copy``, ``pickle``) is a plain
    dict.

    Raises:
        ValueError: ``value`` holds a NaN or infinite float.
    """

    __slots__ = ("text",)

    def __init__(self, value: Mapping[str, Any]):
        super().__init__(value)
        self.text: str = ENCODE(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))


def encode_spliced(body: Mapping[str, Any], outer: str, inner: str) -> str:
    """:data:`ENCODE` of ``body``, the value at ``body[outer][inner]`` written from its
    kept text when it is :class:`Rendered` (module docstring).

    Raises:
        ValueError: ``body`` holds a NaN or infinite float.
    """
    parent = body.get(outer)
    if not isinstance(parent, Mapping) or not isinstance(parent.get(inner), Rendered):
        return ENCODE(body)
    value: Rendered = parent[inner]
    text = ENCODE({**body, outer: {**parent, inner: _SLOT}})
    head, found, tail = text.partition(_SLOT_TEXT)
    if not found or _SLOT_TEXT in tail:  # the stand-in's text occurs elsewhere too
        return ENCODE(body)
    return head + value.text + tail
