"""The spec's [kubernetes] table: a JobSet of pods, its names and values as Kubernetes takes them."""

from __future__ import annotations

import enum
import importlib
import re
from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from launcher.spec.base import INT32_MAX, SECRET, Devices, Port, _Model, _no_control, env_names
from worker.host import layout
from worker.host.env import POD_OWNED

K8sName = re.compile(r"^(?=.{1,63}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")  # a DNS label
K8sSubdomain = re.compile(r"^(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
Dns1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?\Z")  # a Service's name: the JobSet's, its subdomain
LabelName = re.compile(r"^(?=.{1,63}\Z)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")
LabelValue = re.compile(r"^(?=.{0,63}\Z)([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?\Z")
SecretKeyName = re.compile(r"^[-._A-Za-z0-9]{1,253}\Z")
K8sQuantity = re.compile(r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkMGTPE]|Ki|Mi|Gi|Ti|Pi|Ei)?\Z")
_SCALE = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
          **{f"{p}i": 2.0 ** (10 * i) for i, p in enumerate("KMGTPE", 1)}}
# far above any node, well within the 64 bits in which Kubernetes keeps a quantity (cpu in thousandths of a core;
# it caps a larger one without a word)
QUANTITY_MAX = {"cpu": (10**6, "1000000 cores"), "memory": (2**60, "1Ei bytes"), "shm": (2**60, "1Ei bytes")}
ANNOTATIONS_MAX = 256 * 1024  # bytes of all of an object's annotations, keys and values
OWN_LABELS = "mgpu-cluster/"  # the prefix of the labels mgpu-cluster sets itself (mgpu-cluster/run)
# the resources a key of its own sets (cpu, memory, gpus_per_worker), refused in `resources`
OWN_RESOURCES = {"cpu": "cpu", "memory": "memory", "nvidia.com/gpu": "gpus_per_worker"}
RUNS_VOLUME, SHM_VOLUME = "runs", "shm"  # the volumes of volume_claim and shm
VOLUME_SOURCES = ("claim", "host_path", "empty_dir", "nfs", "config_map", "secret")
# [launch] keys that mean nothing to a JobSet, and why
K8S_NOT_LAUNCH = {**dict.fromkeys(("accept_new_host_keys", "connect_timeout"), "no SSH: Kubernetes starts the pods"),
                  **dict.fromkeys(("start_timeout", "heartbeat_timeout"), "no launcher follows the pods"),
                  "max_preemptions": "JobSet restarts a preempted group without counting or limit",
                  "standby": "Kubernetes starts each attempt's pods itself: no standbys",
                  **dict.fromkeys(("rejoin_cooldown", "rejoin_cooldown_max", "regroup_share"),
                                  "elastic runs (min_hosts) are [[hosts]] runs")}
REPLICATED_JOB = "worker"  # the JobSet's one replicated job: pod i is <name>-worker-0-<i>
DEFAULT_NAME = "mgpu"  # a spec that comes from no file (a dict parsed in code)


def pod_host(name: str, index: int | str) -> str:
    """Pod `index`'s host name in JobSet `name` (its Job is <name>-worker-0)."""
    return f"{name}-{REPLICATED_JOB}-0-{index}"


def name_room(workers: int) -> int:
    """The longest JobSet name whose last pod's name (host name, then Kubernetes' 5 random characters) is
    a DNS label of at most 63, as JobSet's webhook requires."""
    return 63 - len(pod_host("", workers - 1) + "-abcde")


def name_from(stem: str, workers: int) -> str:
    """A JobSet name from a spec file's stem ("GPU train.v2" -> "gpu-train-v2"): the same file, the same name."""
    text = re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")
    if not text[:1].isalpha():
        text = f"{DEFAULT_NAME}-{text}".rstrip("-")
    return text[:name_room(workers)].rstrip("-")


def quantity(text: str) -> float:
    """The value of a quantity that K8sQuantity matched (inf where a float cannot hold it)."""
    matched = K8sQuantity.match(text)
    assert matched is not None  # K8sQuantity matched it when the spec was read
    number, suffix = matched.group(1, 3)
    if suffix in _SCALE:
        return float(number) * _SCALE[suffix]
    return float(number + (suffix or ""))  # no suffix, or a decimal exponent: 1e3


def _quantity(value: str, key: str) -> str:
    if not K8sQuantity.match(value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity such as \"4\", \"500m\" or \"16Gi\"")
    limit, words = QUANTITY_MAX[key]
    if quantity(value) > limit:
        raise ValueError(f"{value!r} is more than any pod gets: at most {words}")
    return value


def _object_name(value: str, what: str) -> str:
    if not K8sSubdomain.match(value):
        raise ValueError(f"{value!r} is not {what} name (lower-case letters, digits, '-' and '.', at most 253)")
    return value


def qualified_name(key: str, what: str) -> str:
    """A label, annotation, node-selector or taint key: [prefix/]name, the prefix a DNS subdomain."""
    prefix, _, name = key.rpartition("/")
    if not LabelName.match(name) or (prefix or "/" in key) and not K8sSubdomain.match(prefix):
        raise ValueError(f"{key!r} is not {what} key: a name of at most 63 letters, digits, '-', '_' and '.' "
                         "(starting and ending with a letter or digit), optionally after a DNS prefix and '/' "
                         "(\"nvidia.com/gpu\")")
    return key


def label_value(value: str, where: str) -> str:
    if not LabelValue.match(value):
        raise ValueError(f"{where}: {value!r} is not a label value (at most 63 letters, digits, '-', '_' and '.', "
                         "starting and ending with a letter or digit, or empty)")
    return value


_ENUM = "Possible enum values:"  # Kubernetes' fields: - `"Never"` ...
_VALID = re.compile(r"Valid values are ([A-Za-z, ]+)\.")  # JobSet's: Valid values are A, B, C.
_PATTERN = re.compile(r'must match the regular expression "(\^[^"]+\x24)"')  # a searched text: \x24 is "$"


def _diff(a: object, b: object, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    if a is not None and b is None:
        return [f"{path.lstrip('.')}: not a field the model knows"]
    return [] if a == b else [f"{path.lstrip('.')}: {a!r} became {b!r}"]


def _allowed(description: str | None) -> list[str] | None:
    if description and _ENUM in description:
        return re.findall(r'`"([^"`]+)"`', description.split(_ENUM, 1)[1])
    found = _VALID.search(description or "")
    return [v.strip().removeprefix("and ").strip() for v in found.group(1).split(",")] if found else None


def _values(model: BaseModel, path: str = "") -> list[str]:
    """Strings of `model` (walked whole) that its fields' descriptions do not allow."""
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


def model_problems(model: Any, data: Any) -> list[str]:  # Any: kubeflow_trainer_api has no types
    """What the published model `model` (kubeflow-trainer-api's pydantic models of JobSet and Kubernetes) does
    not take of `data`, an object as Kubernetes spells it: a field it does not know (dropped by the round
    trip), a value of the wrong type, a string outside the values or pattern its description lists."""
    try:
        found = model.from_dict(data)
    except ValidationError as exc:
        return [f"{'.'.join(map(str, e['loc'])) or '(the object)'}: {e['msg']}" for e in exc.errors()] or [str(exc)]
    except ValueError as exc:  # the model's own check
        return [str(exc)]
    return _diff(data, found.to_dict()) + _values(found)


def core_model(name: str) -> Any:  # Any: a kubeflow_trainer_api model class (no types), or None
    """Kubernetes' model io.k8s.api.core.v1.<name> (e.g. "Affinity"), or None where the [kubernetes] extra is
    not installed (then `render` says so, and checks the whole manifest)."""
    module = "io_k8s_api_core_v1_" + re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
    try:
        return getattr(importlib.import_module(f"kubeflow_trainer_api.models.{module}"), f"IoK8sApiCoreV1{name}")
    except ImportError:
        return None


def as_kubernetes(value: Any, name: str) -> Any:
    """A table (or a list of them) passed through to the manifest, checked against Kubernetes' own model."""
    model = core_model(name)
    for i, item in enumerate(value if isinstance(value, list) else [value]):
        where = f"[{i}] " if isinstance(value, list) else ""
        if not isinstance(item, dict):
            raise ValueError(f"{where}must be a table, as Kubernetes spells a {name} (its camelCase keys)")
        problems = model_problems(model, item) if model else []
        if problems:
            raise ValueError(f"{where}not a Kubernetes {name} (an unknown key, a wrong type or value; its keys are "
                             "Kubernetes' camelCase ones): " + "; ".join(problems))
    return value


def _absolute(value: str, what: str) -> str:
    if not value.startswith("/") or not _no_control(value) or value != value.strip():
        raise ValueError(f"{value!r} is not {what}: an absolute path, one line")
    return value


def _not_pods(name: str) -> None:
    if name in POD_OWNED:
        raise ValueError(f"{name}: set in each pod by {POD_OWNED[name]}; leave it out")


class TolerationOperator(str, enum.Enum):
    EQUAL = "Equal"
    EXISTS = "Exists"


class TaintEffect(str, enum.Enum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class PullPolicy(str, enum.Enum):
    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


class Toleration(_Model):
    """A taint the pods tolerate, e.g. { key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }."""

    key: Optional[str] = None  # None with operator Exists: every taint
    operator: Annotated[TolerationOperator, Field(strict=False)] = TolerationOperator.EQUAL
    value: Optional[str] = None
    effect: Optional[Annotated[TaintEffect, Field(strict=False)]] = None  # None: every effect
    toleration_seconds: Optional[Annotated[int, Field(ge=0, le=INT32_MAX)]] = None  # NoExecute: evicted after this

    @field_validator("key")
    @classmethod
    def _key(cls, value: str | None) -> str | None:
        return value if value is None else qualified_name(value, "a taint")

    @model_validator(mode="after")
    def _fits(self) -> Toleration:
        exists = self.operator == TolerationOperator.EXISTS
        if self.key is None and not exists:
            raise ValueError("a toleration with no key tolerates every taint and needs operator = \"Exists\"")
        if exists and self.value is not None:
            raise ValueError("operator \"Exists\" matches any value: leave value out (or use operator \"Equal\")")
        if not exists:
            label_value(self.value or "", "value")
        if self.toleration_seconds is not None and self.effect != TaintEffect.NO_EXECUTE:
            raise ValueError("toleration_seconds is for effect = \"NoExecute\" (how long a pod stays on a node "
                             "tainted while it runs)")
        return self


class SecretKey(_Model):
    """An env value from a key of a Kubernetes Secret: { secret = "wandb", key = "api-key" }."""

    secret: str
    key: str

    _secret = field_validator("secret")(classmethod(lambda cls, v: _object_name(v, "a Secret")))

    @field_validator("key")
    @classmethod
    def _key(cls, value: str) -> str:
        if not SecretKeyName.match(value):
            raise ValueError(f"{value!r} is not a key of a Secret (letters, digits, '-', '_' and '.', at most 253)")
        return value


class Nfs(_Model):
    """An NFS export: { server = "nfs.example.com", path = "/datasets" }."""

    server: str
    path: str

    _path = field_validator("path")(classmethod(lambda cls, v: _absolute(v, "an NFS export")))

    @field_validator("server")
    @classmethod
    def _server(cls, value: str) -> str:
        if not value.strip() or not _no_control(value) or " " in value:
            raise ValueError(f"{value!r} is not a server name or address")
        return value


class Volume(_Model):
    """A volume mounted in every pod besides the run folder's claim: a data set, a node's local SSD. Exactly
    one source: claim, host_path, empty_dir, nfs, config_map or secret."""

    name: str
    mount: str  # where in the container
    read_only: bool = False
    sub_path: Optional[str] = None  # a folder of the volume mounted instead of its root
    claim: Optional[str] = None  # a PersistentVolumeClaim (a data set)
    host_path: Optional[str] = None  # a folder of the node (a local NVMe SSD)
    empty_dir: Union[bool, str, None] = None  # scratch on the node's disk for the pod's life: true, or its size
    nfs: Optional[Nfs] = None
    config_map: Optional[str] = None
    secret: Optional[str] = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not K8sName.match(value):
            raise ValueError(f"{value!r} is not a volume name (a DNS label: at most 63 lower-case letters, digits "
                             "and '-')")
        if value in (RUNS_VOLUME, SHM_VOLUME):
            raise ValueError(f"{value!r} is the name of mgpu-cluster's own volume (volume_claim, shm): pick another")
        return value

    _mount = field_validator("mount")(classmethod(lambda cls, v: _absolute(v, "a mount path")))
    _host = field_validator("host_path")(
        classmethod(lambda cls, v: v if v is None else _absolute(v, "a node's folder")))

    @field_validator("sub_path")
    @classmethod
    def _sub_path(cls, value: str | None) -> str | None:
        if value is not None and (value.startswith("/") or ".." in value.split("/") or not _no_control(value)):
            raise ValueError(f"{value!r} is not a folder inside the volume (relative, no '..')")
        return value

    @field_validator("claim", "config_map", "secret")
    @classmethod
    def _object(cls, value: str | None, info: ValidationInfo) -> str | None:
        what = {"claim": "a PersistentVolumeClaim", "config_map": "a ConfigMap", "secret": "a Secret"}[str(info.field_name)]
        return value if value is None else _object_name(value, what)

    @field_validator("empty_dir")
    @classmethod
    def _size(cls, value: bool | str | None) -> bool | str | None:
        return _quantity(value, "memory") if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_source(self) -> Volume:
        given = [k for k in VOLUME_SOURCES if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"volume {self.name!r}: give exactly one source of {', '.join(VOLUME_SOURCES)} "
                             f"({', '.join(given) or 'none'} given)")
        return self

    def source(self) -> dict[str, dict[str, object]]:
        """The volume's source as Kubernetes spells it."""
        if self.claim:
            read_only = {"readOnly": True} if self.read_only else {}
            return {"persistentVolumeClaim": {"claimName": self.claim, **read_only}}
        if self.host_path:
            return {"hostPath": {"path": self.host_path, "type": "Directory"}}
        if self.empty_dir is not None:
            return {"emptyDir": {"sizeLimit": self.empty_dir} if isinstance(self.empty_dir, str) else {}}
        if self.nfs:
            return {"nfs": {"server": self.nfs.server, "path": self.nfs.path,
                            **({"readOnly": True} if self.read_only else {})}}
        if self.config_map:
            return {"configMap": {"name": self.config_map}}
        return {"secret": {"secretName": self.secret}}

    def mounted(self) -> dict[str, object]:
        """The container's volumeMount of this volume."""
        extra: dict[str, object] = {"readOnly": True} if self.read_only else {}
        extra.update({"subPath": self.sub_path} if self.sub_path else {})
        return {"name": self.name, "mountPath": self.mount, **extra}


class Kubernetes(_Model):
    """A Kubernetes cluster: a JobSet of `workers` pods, rendered by `mgpu-cluster render`."""

    image: str
    workers: Annotated[int, Field(ge=1, le=100000)]  # an Indexed Job's completions are at most 100000
    name: Optional[str] = None  # the JobSet's (and the run's); None: from the spec file's name (specfile)
    namespace: str = "default"
    port: Port = 20000
    gpus_per_worker: Devices = 0  # the nvidia.com/gpu limit of each pod
    python: str = "python3"
    workdir: str = "/workspace"  # the container's working folder; run files in <workdir>/.mgpu/runs/<name>/
    env: Optional[dict[str, str]] = None
    secret_env: Optional[dict[str, SecretKey]] = None  # env values from Secrets (secretKeyRef), never in clear
    cpu: Optional[str] = None  # each pod's CPU request and limit, e.g. "4"
    memory: Optional[str] = None  # each pod's memory request and limit, e.g. "16Gi"
    shm: Union[bool, str] = False  # a memory-backed /dev/shm (NCCL's): true, or its size limit ("16Gi")
    volume_claim: Optional[str] = None  # a PersistentVolumeClaim mounted at workdir/.mgpu: shared by every pod
    node_selector: Optional[dict[str, str]] = None
    tolerations: Optional[list[Toleration]] = None
    image_pull_policy: Optional[Annotated[PullPolicy, Field(strict=False)]] = None
    image_pull_secrets: Optional[list[str]] = None
    service_account: Optional[str] = None
    priority_class: Optional[str] = None
    labels: Optional[dict[str, str]] = None  # on the JobSet and on each pod
    annotations: Optional[dict[str, str]] = None  # on the JobSet and on each pod
    volumes: Optional[list[Volume]] = None  # mounted in every pod besides volume_claim
    resources: Optional[dict[str, Union[int, str]]] = None  # more resources of each pod, e.g. rdma/hca = 1
    host_network: bool = False  # the pods use their nodes' network (RDMA, no overlay): one pod per node
    affinity: Optional[dict[str, Any]] = None  # a Kubernetes Affinity, as Kubernetes spells it
    topology_spread_constraints: Optional[list[dict[str, Any]]] = None  # Kubernetes' TopologySpreadConstraints

    @field_validator("name")
    @classmethod
    def _jobset_name(cls, value: str | None) -> str | None:
        if value is not None and not Dns1035.match(value):
            raise ValueError(f"{value!r} is not a JobSet name: lower-case letters, digits and '-', starting with a "
                             "letter and ending with a letter or digit")
        return value

    @field_validator("namespace")
    @classmethod
    def _name(cls, value: str) -> str:
        if not K8sName.match(value):
            raise ValueError(f"{value!r} is not a Kubernetes namespace (at most 63 lower-case letters, digits and '-')")
        return value

    @field_validator("volume_claim", "service_account", "priority_class")
    @classmethod
    def _object(cls, value: str | None, info: ValidationInfo) -> str | None:
        what = {"volume_claim": "a PersistentVolumeClaim", "service_account": "a ServiceAccount",
                "priority_class": "a PriorityClass"}[str(info.field_name)]
        return value if value is None else _object_name(value, what)

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets(cls, value: list[str] | None) -> list[str] | None:
        for i, name in enumerate(value or ()):
            if not K8sSubdomain.match(name):
                raise ValueError(f"[{i}] {name!r} is not a Secret name (lower-case letters, digits, '-' and '.')")
        return value

    @field_validator("cpu", "memory")
    @classmethod
    def _quantity(cls, value: str | None, info: ValidationInfo) -> str | None:
        return value if value is None else _quantity(value, info.field_name or "")

    @field_validator("shm")
    @classmethod
    def _shm(cls, value: bool | str) -> bool | str:
        return _quantity(value, "shm") if isinstance(value, str) else value

    @field_validator("image", "python", "workdir")
    @classmethod
    def _text(cls, value: str, info: ValidationInfo) -> str:
        if not value.strip() or not _no_control(value) or value != value.strip():
            raise ValueError("must be one line of text, with no space at either end")
        if info.field_name == "workdir" and not value.startswith("/"):
            raise ValueError(f"{value!r} must be an absolute path in the container")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str] | None) -> dict[str, str] | None:
        for name in env_names(env) or {}:
            _not_pods(name)
            if SECRET.search(name):
                raise ValueError(f"{name}: a name that looks secret; its value would be written in clear into the "
                                 "manifest (and the cluster's etcd). Put it in a Kubernetes Secret ('kubectl create "
                                 f"secret generic NAME --from-literal=KEY=...') and set it with secret_env: {name} = "
                                 "{ secret = \"NAME\", key = \"KEY\" }")
        return env

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, env: dict[str, SecretKey] | None) -> dict[str, SecretKey] | None:
        for name in env_names(env) or ():
            _not_pods(name)
        return env

    @field_validator("resources")
    @classmethod
    def _resources(cls, value: dict[str, int | str] | None) -> dict[str, int | str] | None:
        for key, amount in (value or {}).items():
            qualified_name(key, "a resource")
            if key in OWN_RESOURCES:
                raise ValueError(f"{key}: set with the key {OWN_RESOURCES[key]} (it counts the pod's replicas or "
                                 "its limits)")
            whole = "/" in key and not key.split("/")[0].endswith("kubernetes.io")  # an extended resource
            if isinstance(amount, int) and not 1 <= amount <= 2**62:
                raise ValueError(f"{key}: {amount}: give a count of at least 1 (leave out a resource the pods do "
                                 "not need)")
            if isinstance(amount, str):
                _quantity(amount, "memory")
                if whole and not re.fullmatch(r"[0-9]+", amount):
                    raise ValueError(f"{key}: {amount!r}: a device (an extended resource) is counted in whole units")
        return value

    @field_validator("affinity")
    @classmethod
    def _affinity(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:  # Any: Kubernetes' own
        return value if value is None else as_kubernetes(value, "Affinity")

    @field_validator("topology_spread_constraints")
    @classmethod
    def _spread(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:  # Any: Kubernetes' own
        return value if value is None else as_kubernetes(value, "TopologySpreadConstraint")

    @field_validator("labels", "node_selector")
    @classmethod
    def _labels(cls, value: dict[str, str] | None, info: ValidationInfo) -> dict[str, str] | None:
        for key, text in (value or {}).items():
            qualified_name(key, "a label")
            label_value(text, key)
            if info.field_name == "labels" and key.startswith(OWN_LABELS):
                raise ValueError(f"{key}: labels under {OWN_LABELS} are set by mgpu-cluster itself")
        return value

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key in value or {}:
            qualified_name(key, "an annotation")
        if sum(len(k.encode()) + len(v.encode()) for k, v in (value or {}).items()) > ANNOTATIONS_MAX:
            raise ValueError("more than Kubernetes keeps: at most 256 KiB of annotations, keys and values")
        return value

    @model_validator(mode="after")
    def _fits(self) -> Kubernetes:
        both = sorted(set(self.env or {}) & set(self.secret_env or {}))
        if both:
            raise ValueError(f"env and secret_env both set {', '.join(both)}: keep one")
        own = {RUNS_VOLUME: layout.mgpu_dir(self.workdir)} if self.volume_claim else {}
        own.update({SHM_VOLUME: "/dev/shm"} if self.shm is not False else {})
        names: set[str] = set()
        mounts = {path: f"{key} (volume_claim)" if key == RUNS_VOLUME else f"{key} (shm)"
                                for key, path in own.items()}
        for volume in self.volumes or ():
            if volume.name in names:
                raise ValueError(f"volumes: two volumes named {volume.name!r}: give each its own name")
            if volume.mount.rstrip("/") in mounts:
                raise ValueError(f"volumes: {volume.name!r} and {mounts[volume.mount.rstrip('/')]} both mount at "
                                 f"{volume.mount}: give each its own path")
            names.add(volume.name)
            mounts[volume.mount.rstrip("/") or "/"] = repr(volume.name)
        room = name_room(self.workers)
        if self.name is not None and len(self.name) > room:
            raise ValueError(f"name {self.name!r} is too long for the names of its pods (the last, "
                             f"{pod_host(self.name, self.workers - 1)}-xxxxx, must be at most 63 characters): "
                             f"with {self.workers} worker(s) give a name of at most {room} characters")
        return self

    @property
    def jobset(self) -> str:
        """The JobSet's name, which is also the run's id: the same spec renders the same object."""
        return self.name or DEFAULT_NAME

    def named(self, stem: str) -> Kubernetes:
        """This table with its name taken from the spec file's stem where it sets none."""
        return self if self.name else self.model_copy(update={"name": name_from(stem, self.workers)})
