"""A rendered manifest checked against JobSet's published API models (the kubeflow-trainer-api package's
pydantic models of jobset.x-k8s.io/v1alpha2, with the Kubernetes Job and Pod specs inside): a field the
models do not know is dropped by the round trip, and a value of the wrong type is refused."""

from __future__ import annotations


class ManifestError(ValueError):
    """The manifest is not a valid JobSet."""


def _diff(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path.lstrip('.')}: {a!r} became {b!r}"]


def validate(data: dict) -> dict:
    """`data` unchanged when JobSet's models take it whole; ManifestError naming what they do not."""
    try:
        from kubeflow_trainer_api.models.jobset_v1alpha2_job_set import JobsetV1alpha2JobSet
    except ImportError as exc:
        raise ManifestError("checking a manifest needs the kubeflow-trainer-api package: "
                            "pip install 'mgpu-cluster[kubernetes]'") from exc
    try:
        back = JobsetV1alpha2JobSet.from_dict(data).to_dict()
    except ValueError as exc:  # pydantic's ValidationError
        raise ManifestError(f"not a valid JobSet: {exc}") from None
    problems = _diff(data, back)
    if problems:
        raise ManifestError("fields JobSet's API does not know, or of the wrong type: " + "; ".join(problems))
    return data
