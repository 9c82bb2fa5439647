"""A rendered manifest checked against JobSet's published API models (the kubeflow-trainer-api package's
pydantic models of jobset.x-k8s.io/v1alpha2, with the Kubernetes Job and Pod specs inside): a field the
models do not know is dropped by the round trip, a value of the wrong type is refused, and a string
outside the values (or the pattern) that a field's own description in the models lists is refused."""

from __future__ import annotations

import re

from launcher.errors import MgpuError

_ENUM = "Possible enum values:"  # Kubernetes' fields: - `"Never"` ...
_VALID = re.compile(r"Valid values are ([A-Za-z, ]+)\.")  # JobSet's: Valid values are A, B, C.
_PATTERN = re.compile(r'must match the regular expression "(\^[^"]+\$)"')


class ManifestError(MgpuError):
    """The manifest cannot be checked (the package is missing) or is not a valid JobSet; one paragraph."""

    exit_code = 2


def _diff(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path.lstrip('.')}: {a!r} became {b!r}"]


def _allowed(description: str | None) -> list[str] | None:
    if description and _ENUM in description:
        return re.findall(r'`"([^"`]+)"`', description.split(_ENUM, 1)[1])
    found = _VALID.search(description or "")
    return [v.strip().removeprefix("and ").strip() for v in found.group(1).split(",")] if found else None


def _values(model, path: str = "") -> list[str]:
    """Strings of `model` (a JobSet model, walked whole) that its fields' descriptions do not allow."""
    from pydantic import BaseModel

    problems = []
    for name, field in type(model).model_fields.items():
        value, where = getattr(model, name), f"{path}.{field.alias or name}"
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            at = f"{where}[{i}]" if isinstance(value, list) else where
            if isinstance(item, BaseModel):
                problems += _values(item, at)
            elif isinstance(item, str):
                allowed, pattern = _allowed(field.description), _PATTERN.search(field.description or "")
                if allowed and item not in allowed:
                    problems.append(f"{at.lstrip('.')}: {item!r} is not one of {', '.join(allowed)}")
                elif pattern and not re.fullmatch(pattern.group(1), item):
                    problems.append(f"{at.lstrip('.')}: {item!r} does not match {pattern.group(1)}")
    return problems


def validate(data: dict) -> dict:
    """`data` unchanged when JobSet's models take it whole; ManifestError naming what they do not."""
    try:
        from kubeflow_trainer_api.models.jobset_v1alpha2_job_set import JobsetV1alpha2JobSet
    except ImportError as exc:
        raise ManifestError("checking a manifest needs the kubeflow-trainer-api package: "
                            "pip install 'mgpu-cluster[kubernetes]'") from exc
    try:
        model = JobsetV1alpha2JobSet.from_dict(data)
    except ValueError as exc:  # pydantic's ValidationError
        raise ManifestError(f"not a valid JobSet: {exc}") from None
    problems = _diff(data, model.to_dict()) + _values(model)
    if problems:
        raise ManifestError("not what JobSet's API takes (an unknown field, a wrong type or value): "
                            + "; ".join(problems))
    return data
