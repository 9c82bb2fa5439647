"""The spec's [kubernetes] table: a JobSet of pods, its names and values as Kubernetes takes them."""

from __future__ import annotations

import enum
import re
from typing import Annotated, Optional, Union

from pydantic import Field, field_validator, model_validator

from launcher.specbase import INT32_MAX, SECRET, Devices, Port, _Model, _no_control, env_names

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
# set by Kubernetes (the Job's index); the pod entry's own, from it, are worker.host.env's OWNED (specbase.env_names)
K8S_OWN_ENV = ("JOB_COMPLETION_INDEX",)
# [launch] keys that mean nothing to a JobSet, and why
K8S_NOT_LAUNCH = {**dict.fromkeys(("accept_new_host_keys", "connect_timeout"), "no SSH: Kubernetes starts the pods"),
                  **dict.fromkeys(("start_timeout", "heartbeat_timeout"), "no launcher follows the pods"),
                  "max_preemptions": "JobSet restarts a preempted group without counting or limit",
                  "standby": "Kubernetes starts each attempt's pods itself: no standbys"}
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
    number, suffix = K8sQuantity.match(text).group(1, 3)
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
    def _key(cls, value):
        return value if value is None else qualified_name(value, "a taint")

    @model_validator(mode="after")
    def _fits(self):
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
    def _key(cls, value):
        if not SecretKeyName.match(value):
            raise ValueError(f"{value!r} is not a key of a Secret (letters, digits, '-', '_' and '.', at most 253)")
        return value


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

    @field_validator("name")
    @classmethod
    def _jobset_name(cls, value):
        if value is not None and not Dns1035.match(value):
            raise ValueError(f"{value!r} is not a JobSet name: lower-case letters, digits and '-', starting with a "
                             "letter and ending with a letter or digit")
        return value

    @field_validator("namespace")
    @classmethod
    def _name(cls, value):
        if not K8sName.match(value):
            raise ValueError(f"{value!r} is not a Kubernetes namespace (at most 63 lower-case letters, digits and '-')")
        return value

    @field_validator("volume_claim", "service_account", "priority_class")
    @classmethod
    def _object(cls, value, info):
        what = {"volume_claim": "a PersistentVolumeClaim", "service_account": "a ServiceAccount",
                "priority_class": "a PriorityClass"}[info.field_name]
        return value if value is None else _object_name(value, what)

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets(cls, value):
        for i, name in enumerate(value or ()):
            if not K8sSubdomain.match(name):
                raise ValueError(f"[{i}] {name!r} is not a Secret name (lower-case letters, digits, '-' and '.')")
        return value

    @field_validator("cpu", "memory")
    @classmethod
    def _quantity(cls, value, info):
        return value if value is None else _quantity(value, info.field_name)

    @field_validator("shm")
    @classmethod
    def _shm(cls, value):
        return _quantity(value, "shm") if isinstance(value, str) else value

    @field_validator("image", "python", "workdir")
    @classmethod
    def _text(cls, value, info):
        if not value.strip() or not _no_control(value) or value != value.strip():
            raise ValueError("must be one line of text, with no space at either end")
        if info.field_name == "workdir" and not value.startswith("/"):
            raise ValueError(f"{value!r} must be an absolute path in the container")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, env):
        for name in env_names(env) or {}:
            if name in K8S_OWN_ENV:
                raise ValueError(f"{name}: set in each pod by Kubernetes (the Job's index); leave it "
                                 "out")
            if SECRET.search(name):
                raise ValueError(f"{name}: a name that looks secret; its value would be written in clear into the "
                                 "manifest (and the cluster's etcd). Put it in a Kubernetes Secret ('kubectl create "
                                 f"secret generic NAME --from-literal=KEY=...') and set it with secret_env: {name} = "
                                 "{ secret = \"NAME\", key = \"KEY\" }")
        return env

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, env):
        for name in sorted(set(env_names(env) or ()) & set(K8S_OWN_ENV)):
            raise ValueError(f"{name}: set in each pod by Kubernetes (the Job's index); leave it out")
        return env

    @field_validator("labels", "node_selector")
    @classmethod
    def _labels(cls, value, info):
        for key, text in (value or {}).items():
            qualified_name(key, "a label")
            label_value(text, key)
            if info.field_name == "labels" and key.startswith(OWN_LABELS):
                raise ValueError(f"{key}: labels under {OWN_LABELS} are set by mgpu-cluster itself")
        return value

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, value):
        for key in value or {}:
            qualified_name(key, "an annotation")
        if sum(len(k.encode()) + len(v.encode()) for k, v in (value or {}).items()) > ANNOTATIONS_MAX:
            raise ValueError("more than Kubernetes keeps: at most 256 KiB of annotations, keys and values")
        return value

    @model_validator(mode="after")
    def _fits(self):
        both = sorted(set(self.env or {}) & set(self.secret_env or {}))
        if both:
            raise ValueError(f"env and secret_env both set {', '.join(both)}: keep one")
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
