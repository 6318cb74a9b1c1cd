"""The run config: one pydantic schema for every run spec, loaded from YAML with errors that name the field
and say how to fix it. Services receive it as JSON over the control plane and validate it again."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A run config that cannot be used. The message names each bad field and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EnvConfig(_Strict):
    id: str = Field("CartPole-v1", description="a registered gymnasium id")
    num_envs: int = Field(8, ge=1, le=4096)
    vectorization: Literal["sync", "async"] = "sync"
    kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to gymnasium.make")
    eval_envs: int = Field(10, ge=1, le=1024, description="envs (one episode each) used for evaluation")


class PolicyConfig(_Strict):
    hidden_sizes: list[int] = Field(default_factory=lambda: [64, 64])
    activation: Literal["tanh", "relu"] = "tanh"
    log_std_init: float = 0.0
    ortho_init: bool = True

    @model_validator(mode="after")
    def _positive_sizes(self) -> PolicyConfig:
        if not self.hidden_sizes or any(h <= 0 for h in self.hidden_sizes):
            raise ValueError("hidden_sizes must be a non-empty list of positive integers, e.g. [64, 64]")
        return self


class PPOConfig(_Strict):
    n_steps: int = Field(32, ge=1, description="steps per env per batch")
    batch_size: int = Field(256, ge=1, description="minibatch size")
    n_epochs: int = Field(20, ge=1)
    gamma: float = Field(0.98, gt=0, le=1)
    gae_lambda: float = Field(0.8, ge=0, le=1)
    learning_rate: float = Field(1e-3, gt=0)
    lr_schedule: Literal["constant", "linear"] = "linear"
    clip_range: float = Field(0.2, gt=0)
    clip_schedule: Literal["constant", "linear"] = "linear"
    clip_range_vf: float | None = Field(None, gt=0, description="None disables value clipping")
    ent_coef: float = 0.0
    vf_coef: float = Field(0.5, ge=0)
    max_grad_norm: float = Field(0.5, gt=0)
    normalize_advantage: bool = True
    target_kl: float | None = Field(None, gt=0)


class SACConfig(_Strict):
    n_steps: int = Field(32, ge=1, description="steps per env per iteration (one epoch: collect, then update)")
    batch_size: int = Field(256, ge=1, description="minibatch size sampled from the replay window")
    learning_rate: float = Field(3e-4, gt=0)
    gamma: float = Field(0.99, gt=0, le=1)
    tau: float = Field(0.005, gt=0, le=1, description="Polyak factor of the target critics")
    learning_starts: int = Field(1000, ge=0, description="env steps of uniform random actions before updates")
    updates_per_env_step: float = Field(1.0, gt=0, le=64, description="gradient steps per env step collected")
    ent_coef: float | Literal["auto"] = Field("auto", description="entropy weight alpha, or auto-tuned")
    target_entropy: float | None = Field(None, description="auto alpha target; default -action_dim")


ALGORITHM_FAMILY = {"ppo": "on-policy", "sac": "off-policy"}


class AlgorithmConfig(_Strict):
    name: Literal["ppo", "sac"] = "ppo"
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    sac: SACConfig = Field(default_factory=SACConfig)

    @property
    def family(self) -> str:
        """on-policy: the learner consumes each batch once; off-policy: it samples a replay window."""
        return ALGORITHM_FAMILY[self.name]

    @property
    def n_steps(self) -> int:
        return self.sac.n_steps if self.name == "sac" else self.ppo.n_steps


class TrainConfig(_Strict):
    total_env_steps: int = Field(100_000, ge=1)
    eval_every_iterations: int = Field(10, ge=0, description="0 disables periodic evaluation")
    eval_episodes: int = Field(10, ge=1)
    stop_at_eval_return: float | None = Field(None, description="stop early once eval mean return reaches it")
    checkpoint_key: str = "checkpoints/final.pt"


class CheckpointConfig(_Strict):
    every_iterations: int = Field(10, ge=0, description="periodic checkpoints; 0 = only final and on-stop")
    keep: int = Field(3, ge=1, description="periodic checkpoints kept; older ones are deleted")


STAGES = ("env", "rollout", "learner")
MODES = ("collocated", "disaggregated", "hybrid")


class PoolConfig(_Strict):
    """A resource pool: the workers of the stages placed on it share these units."""

    cores: int = Field(1, ge=1, le=4096, description="CPU cores in the pool")
    gpus: int = Field(0, ge=0, le=4096, description="GPUs in the pool (0 on CPU hosts)")


class SchedulingConfig(_Strict):
    """How the one logical workflow is executed. Stages placed on the same pool share its workers and take
    turns; stages on different pools run concurrently. The three modes are names for placements:
    collocated = one pool for all, disaggregated = a pool per stage, hybrid = the declared ``placement``."""

    mode: Literal["collocated", "disaggregated", "hybrid", "auto"] = Field(
        "collocated", description="auto = profile, predict every candidate plan, run the fastest")
    pools: dict[str, PoolConfig] = Field(default_factory=dict,
                                         description="resource pools by name; default: one per placed pool name")
    placement: dict[str, str] = Field(default_factory=dict,
                                      description="hybrid: stage (env, rollout, learner) -> pool name")
    pipeline_chunks: int = Field(2, ge=1, le=64, description="env chunks pipelined against inference")
    staleness: int = Field(0, ge=0, le=64, description="max weight versions a batch may lag (0 = on-policy)")
    env_placement: Literal["auto", "env_service", "rollout"] = Field(
        "auto", description="where the env pool runs: its own service, or inside the rollout worker (no IPC per "
                            "step); auto = inside the rollout worker when env and rollout share a pool and no "
                            "chunks are pipelined, else the env service")
    rollout_workers: int = Field(1, ge=1, le=1024, description="rollout workers sharing the env batch")
    env_workers: int = Field(1, ge=1, le=1024, description="env services (rollout worker w uses env w % n)")
    profile_iterations: int = Field(3, ge=1, le=100, description="auto: iterations measured per profiled plan")
    candidates: list[str] = Field(default_factory=list,
                                  description="auto: plan names to consider (default: every candidate)")
    dynamic: bool = Field(False, description="move the env stage between env services and rollout workers at epoch "
                                             "boundaries from measured utilisation (kept only if it pays)")
    dynamic_every: int = Field(10, ge=2, le=10_000, description="iterations per dynamic-scheduling window")
    offload: Literal["off", "auto", "host", "disk"] = Field(
        "off", description="when learner and rollout share a pool and take turns, the idle one moves its model "
                           "(and optimiser) state off the device between turns: host = to host memory (a GPU "
                           "device), disk = to a file (frees RAM on a CPU host), auto = host on a GPU, else disk")

    @model_validator(mode="after")
    def _placement(self) -> SchedulingConfig:
        unknown = sorted(set(self.placement) - set(STAGES))
        if unknown:
            raise ValueError(f"placement names unknown stage(s) {unknown}; stages are {', '.join(STAGES)}")
        if self.mode == "hybrid":
            missing = [s for s in STAGES if s not in self.placement]
            if missing:
                raise ValueError(f"hybrid mode needs placement for every stage, missing {missing}; e.g. "
                                 f"placement: {{env: a, rollout: a, learner: b}}")
        if self.pools:
            undeclared = sorted({p for p in self.placement.values() if p not in self.pools})
            if undeclared:
                raise ValueError(f"placement uses pool(s) {undeclared} not declared in pools "
                                 f"({', '.join(self.pools)}); declare them or fix the names")
        return self

    def resolved_placement(self) -> dict[str, str]:
        """Stage -> pool for the mode: collocated shares one pool, disaggregated gives each stage its own."""
        if self.mode == "collocated":
            pool = next(iter(self.pools), "shared")
            return {s: pool for s in STAGES}
        if self.mode == "disaggregated":
            names = list(self.pools) if len(self.pools) >= 3 else list(STAGES)
            return {s: names[i] for i, s in enumerate(STAGES)}
        if self.mode == "hybrid":
            return dict(self.placement)
        return {s: "shared" for s in STAGES}  # auto: the chosen plan replaces this before any worker runs

    def env_in_rollout(self) -> bool:
        if self.env_placement != "auto":
            return self.env_placement == "rollout"
        where = self.resolved_placement()
        shared = where["env"] == where["rollout"]
        return shared and (self.mode == "collocated" or self.pipeline_chunks == 1)

    def chunks(self) -> int:
        """Envs simulated in the rollout process step the whole shard at once; an env service pipelines chunks."""
        return 1 if self.env_in_rollout() else self.pipeline_chunks

    def learner_overlaps(self) -> bool:
        """A learner on its own pool consumes a stream of batches while rollout produces the next ones."""
        where = self.resolved_placement()
        return where["learner"] != where["rollout"]

    def effective_staleness(self) -> int:
        return self.staleness if self.learner_overlaps() else 0

    def offload_target(self, device: str) -> str | None:
        """Where the idle stage's model state goes between turns, or None when stages do not take turns."""
        if self.offload == "off" or self.learner_overlaps():
            return None
        if self.offload == "auto":
            return "disk" if device == "cpu" else "host"
        return self.offload


class WeightSyncConfig(_Strict):
    transport: Literal["zmq", "gloo", "nccl"] = Field(
        "zmq", description="zmq: the data plane; gloo/nccl: torch.distributed carries the tensors")
    bucket_bytes: int = Field(32 * 2**20, ge=1024, description="weights move in buckets of at most this size")
    delta: bool = Field(False, description="send only the tensors/elements that changed since the held version")
    delta_max_fraction: float = Field(0.25, gt=0, le=1,
                                      description="element deltas only when fewer than this fraction changed")


class ReplayConfig(_Strict):
    store: Literal["memory", "redis"] = "memory"
    capacity_transitions: int = Field(1_000_000, ge=1)
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="used when store is redis")
    key_prefix: str = Field("rlfabric", description="Redis keys live under <key_prefix>:<run_id>:")
    connect_timeout_s: float = Field(5.0, gt=0)
    retry_attempts: int = Field(5, ge=0, description="bounded retries when Redis is lost mid-run")
    retry_backoff_s: float = Field(0.2, ge=0)
    offload_bytes: int = Field(1 << 20, ge=1024,
                               description="tensors larger than this go to the object store by reference")


class StorageConfig(_Strict):
    kind: Literal["filesystem", "s3"] = "filesystem"
    root: str = Field("", description="filesystem root; default: the run directory")
    endpoint: str = Field("", description="S3/MinIO host:port, e.g. minio:9000")
    bucket: str = Field("rlfabric", min_length=3, max_length=63)
    prefix: str = Field("", description="key prefix inside the bucket")
    access_key: str = Field("", description="default: $RLFABRIC_S3_ACCESS_KEY")
    secret_key: str = Field("", description="default: $RLFABRIC_S3_SECRET_KEY")
    region: str = "us-east-1"
    secure: bool = False
    create_bucket: bool = Field(True, description="create a missing bucket (else: a clear error)")


class DataPlaneConfig(_Strict):
    max_message_bytes: int = Field(256 * 2**20, ge=1024)
    timeout_s: float = Field(30.0, gt=0, description="how long a data-plane request waits for its peer")
    high_water_mark: int = Field(64, ge=1)


class RuntimeConfig(_Strict):
    torch_threads: int = Field(1, ge=1, le=256)
    device: Literal["cpu"] = Field(
        "cpu", description="where learner and rollout models live. Only cpu for now: placing the models on a GPU "
                           "(cuda) is not implemented yet; weights can still move over NCCL (weight_sync)")
    worker_wait_s: float = Field(60.0, gt=0, description="how long a run waits for workers to register")


class RunConfig(_Strict):
    name: str = "run"
    seed: int = 0
    env: EnvConfig = Field(default_factory=EnvConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    data_plane: DataPlaneConfig = Field(default_factory=DataPlaneConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        sched = self.scheduling
        if sched.offload == "host" and self.runtime.device == "cpu":
            raise ValueError("scheduling.offload=host moves model state to host memory, but runtime.device is cpu: "
                             "it is there already; use offload: disk (frees the RAM) or auto")
        if sched.rollout_workers > self.env.num_envs:
            raise ValueError(f"scheduling.rollout_workers={sched.rollout_workers} exceeds env.num_envs="
                             f"{self.env.num_envs}: every rollout worker needs at least one env")
        for w, n in enumerate(self.shard_sizes()):
            if n % sched.chunks() != 0:
                raise ValueError(
                    f"env.num_envs={self.env.num_envs} over {sched.rollout_workers} rollout worker(s) gives worker "
                    f"{w} {n} envs, not divisible by scheduling.pipeline_chunks={sched.pipeline_chunks}; pick a "
                    f"chunk count that divides each worker's env count")
        return self

    def shard_sizes(self, workers: int | None = None) -> list[int]:
        """Envs per rollout worker: the env batch split as evenly as possible (the first ones get the rest)."""
        w = workers or self.scheduling.rollout_workers
        n = self.env.num_envs
        return [n // w + (i < n % w) for i in range(w)]

    def eval_seed(self) -> int:
        """Evaluation envs are seeded apart from training envs; ``rlfabric eval`` reuses this by default."""
        return self.seed + 100_000

    def batch_env_steps(self) -> int:
        return self.algorithm.n_steps * self.env.num_envs

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        try:
            return cls.model_validate(json.loads(text))
        except (ValidationError, json.JSONDecodeError) as exc:
            raise ConfigError(_explain(exc, "config_json")) from None


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """Names valid at a location, to suggest the closest one for a typo."""
    current: Any = model
    for part in loc[:-1]:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = field.annotation
    return list(getattr(current, "model_fields", {}).keys())


def _description_at(model: type[BaseModel], loc: tuple) -> str:
    """A field's documented meaning, where a bare list of allowed values would not say why."""
    current: Any = model
    for part in loc:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return ""
        current = field.annotation
    return field.description or ""


def _explain(exc: Exception, source: str) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{source}: not valid JSON ({exc}). Fix: send RunConfig.to_json() output"
    assert isinstance(exc, ValidationError)
    lines = [f"{source}: {exc.error_count()} invalid field(s)"]
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        field = ".".join(loc) or "(top level)"
        got = err.get("input")
        if err["type"] == "extra_forbidden":
            valid = _fields_at(RunConfig, loc)
            close = difflib.get_close_matches(loc[-1], valid, n=1)
            hint = f"did you mean '{'.'.join(loc[:-1] + (close[0],))}'?" if close else f"valid keys: {', '.join(valid)}"
            lines.append(f"  {field}: unknown field. Fix: remove it; {hint}")
        elif err["type"] == "literal_error":
            why = _description_at(RunConfig, loc)
            lines.append(f"  {field}: {err['msg']} (got {got!r}). Fix: use one of the listed values"
                         + (f" ({field}: {why})" if why else ""))
        elif err["type"] == "missing":
            lines.append(f"  {field}: required. Fix: add it")
        elif not loc:  # a check across fields: its message names them and the fix
            lines.append(f"  {err['msg'].removeprefix('Value error, ')}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {field}: {msg} (got {got!r}). Fix: set {field} to a valid value")
    return "\n".join(lines)


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides (values parsed as YAML scalars) to a raw config dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value, e.g. --set train.total_env_steps=50000")
        key, value = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ConfigError(f"--set {item!r}: empty key. Fix: name a field, e.g. seed=1")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = _parse_value(value)
    return data


def parse_config(text: str, source: str = "config", overrides: list[str] | None = None) -> RunConfig:
    """Parse YAML text into a RunConfig, raising ConfigError with the field, the problem and the fix."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(
            f"{source}:{where}: malformed YAML ({problem}). Fix: check indentation and 'key: value' syntax there"
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections (env:, train:, ...), "
                          f"got {type(data).__name__}")
    data = apply_overrides(data, overrides or [])
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file. Fix: pass a YAML run spec, e.g. examples/cartpole_ppo.yaml")
    return parse_config(path.read_text(), str(path), overrides)


def dump_yaml(config: RunConfig) -> str:
    return yaml.safe_dump(json.loads(config.to_json()), sort_keys=False)
