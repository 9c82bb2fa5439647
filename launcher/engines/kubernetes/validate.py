"""A rendered manifest checked against JobSet's published API models (the kubeflow-trainer-api package's
pydantic models of jobset.x-k8s.io/v1alpha2, with the Kubernetes Job and Pod specs inside): a field the
models do not know is dropped by the round trip, a value of the wrong type is refused, and a string
outside the values (or the pattern) that a field's own description in the models lists is refused."""

from __future__ import annotations

from launcher.errors import MgpuError
from launcher.engines.kubernetes.render import Manifest
from launcher.spec.kubernetes import model_problems


class ManifestError(MgpuError):
    """The manifest cannot be checked (the package is missing) or is not a valid JobSet; one paragraph."""

    exit_code = 2


def validate(data: Manifest) -> Manifest:
    """`data` unchanged when JobSet's models take it whole; ManifestError naming what they do not."""
    try:
        from kubeflow_trainer_api.models.jobset_v1alpha2_job_set import JobsetV1alpha2JobSet
    except ImportError as exc:
        raise ManifestError("checking a manifest needs the kubeflow-trainer-api package: "
                            "pip install 'mgpu-cluster[kubernetes]'") from exc
    try:
        JobsetV1alpha2JobSet.from_dict(data)
    except ValueError as exc:  # pydantic's ValidationError
        raise ManifestError(f"not a valid JobSet: {exc}") from None
    problems = model_problems(JobsetV1alpha2JobSet, data)
    if problems:
        raise ManifestError("not what JobSet's API takes (an unknown field, a wrong type or value): "
                            + "; ".join(problems))
    return data
