"""A TrainJob checked against Kubeflow's own models (``kubeflow-trainer-api`` 2.3.0, generated
from Trainer v2.3.0's OpenAPI), strictly.

The generated pydantic models ignore a key they do not know (no ``extra="forbid"``), and their
``from_dict`` drops it silently. So :func:`strict_trainjob` does three things: it walks the
document beside the models, field by field (every key must be a field's JSON name, recursively
through nested models, lists and maps), builds the model (``from_dict``: types are checked,
``StrictStr``/``StrictInt``), and requires the model to give back exactly the document
(``to_dict``): nothing dropped, nothing changed.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob
from pydantic import BaseModel


class StrictModelError(ValueError):
    """The document is not a TrainJob as Trainer v2.3.0 defines it."""


def _element(annotation: Any) -> Any:
    """What a field holds, unwrapped: a model class, ``("list", X)``, ``("dict", X)`` or None
    (a scalar, or a oneOf wrapper such as Quantity, checked by building the model)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _element(args[0])
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _element(inner[0]) if len(inner) == 1 else None
    if origin is list:
        return ("list", _element(args[0]))
    if origin is dict:
        return ("dict", _element(args[1]))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return None if "actual_instance" in annotation.model_fields else annotation
    return None


def unknown_fields(doc: Any, kind: Any, path: str = "") -> list[str]:
    """Every key of ``doc`` that its model (``kind``, as :func:`_element` gives it) has no
    field for, as a dotted path."""
    if kind is None:
        return []
    if isinstance(kind, tuple):
        container, inner = kind
        if container == "list" and isinstance(doc, list):
            return [u for i, v in enumerate(doc) for u in unknown_fields(v, inner, f"{path}[{i}]")]
        if container == "dict" and isinstance(doc, dict):
            return [u for k, v in doc.items() for u in unknown_fields(v, inner, f"{path}[{k}]")]
        return [f"{path} (not a {container})"]
    if not isinstance(doc, dict):
        return [f"{path} (not an object)"]
    fields = {(f.alias or n): f for n, f in kind.model_fields.items()}
    out: list[str] = []
    for key, value in doc.items():
        if key not in fields:
            out.append(f"{path}.{key}".lstrip("."))
        else:
            out += unknown_fields(value, _element(fields[key].annotation), f"{path}.{key}")
    return out


def strict_trainjob(doc: dict[str, Any]) -> TrainerV1alpha1TrainJob:
    """The TrainJob model of ``doc``; raises :class:`StrictModelError` for an unknown field, a
    value of the wrong type, or anything the model would not give back unchanged."""
    unknown = unknown_fields(doc, TrainerV1alpha1TrainJob)
    if unknown:
        raise StrictModelError(f"unknown field(s): {', '.join(unknown)}")
    try:
        model = TrainerV1alpha1TrainJob.from_dict(doc)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise StrictModelError(str(exc)) from None
    back = model.to_dict()
    if back != doc:
        raise StrictModelError(f"the model does not give the document back: {back!r}")
    return model
