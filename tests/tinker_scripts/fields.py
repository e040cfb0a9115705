"""Run under the tinker SDK's venv (tests/tinker/test_tinker_fields.py): every public method of the
SDK's clients, and every request type the SDK can send as {class name: [field names]}. It starts from each ``*Request`` class in ``tinker.types``
and follows the types of their fields (a Datum, its chunks, TensorData, SamplingParams, ...) and the
subclasses of every type it reaches (the optimizer families, say), so a type or field a later SDK
adds is found without naming it here."""

import dataclasses
import inspect
import json
import sys
import typing

import numpy
import pydantic
import tinker
import tinker.types as t

spec = json.loads(sys.argv[1])


def fields_of(cls) -> dict | None:
    if isinstance(cls, type) and issubclass(cls, pydantic.BaseModel):
        return {name: f.annotation for name, f in cls.model_fields.items()}
    if dataclasses.is_dataclass(cls):
        return {f.name: resolve(f.type) for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    return None


def resolve(annotation):
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, {**vars(typing), **vars(t), "np": numpy})
    except Exception:  # a type this walk cannot name is no request type of the SDK's
        return None


def sdk_class(cls) -> bool:
    return isinstance(cls, type) and cls.__module__.split(".")[0] == "tinker" and fields_of(cls) is not None


def classes_in(annotation, found: set) -> None:
    if sdk_class(annotation):
        found.add(annotation)
    for arg in typing.get_args(annotation):
        classes_in(arg, found)


public = [c for _, c in inspect.getmembers(t, inspect.isclass) if sdk_class(c)]
todo = [c for c in public if c.__name__.endswith("Request")]
seen: dict[str, list[str]] = {}
reached: set = set()
while todo:
    cls = todo.pop()
    if cls.__name__ in seen:
        continue
    fields = fields_of(cls)
    seen[cls.__name__] = sorted(fields)
    reached.add(cls)
    found: set = set()
    for annotation in fields.values():
        classes_in(annotation, found)
    found |= {c for c in public if c not in reached and any(issubclass(c, r) for r in reached)}
    todo += [c for c in found if c.__name__ not in seen]
clients = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient", "AdminClient")
methods = [
    f"{name}.{method}"
    for name in clients
    for method, _ in inspect.getmembers(getattr(tinker, name), callable)
    if not method.startswith("_")
]
with open(spec["out"], "w") as f:
    json.dump({"types": seen, "methods": methods}, f)
