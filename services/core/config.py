"""The run config: one pydantic schema for every run spec, loaded from YAML with errors that name the field
and say how to fix it. Services receive it as JSON over the control plane and validate it again."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from rlfabric.services.core.algorithm import ALGORITHMS, load_algorithms
from rlfabric.services.core.options import (
    BACKEND_OPTIONS,
    POLICY_OPTIONS,
    LoRAConfig,
    Options,
    option_sections,
)
from rlfabric.services.core.registry import (
    IMPORT_PATHS_FLAG,
    import_paths_allowed,
    is_literal,
    refuse_import_path,
)
from rlfabric.services.core.spec_yaml import ConfigError, read_spec, read_spec_file


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


HEADLESS_RENDER_MODES = ("rgb_array", "rgb_array_list", "depth_array", "ansi")


class EnvConfig(_Strict):
    adapter: str = Field("gymnasium", max_length=300,
                         pattern=r"^[A-Za-z_][A-Za-z0-9_.]*(:[A-Za-z_][A-Za-z0-9_.]*)?$",
                         description="the env adapter (services/env/adapters): gymnasium, minigrid, ..., an "
                                     "rlfabric.env_adapters entry point, or package.module")
    id: str = Field("CartPole-v1", description="the env id the adapter makes (a registered gymnasium id)")
    num_envs: int = Field(8, ge=1, le=4096)
    vectorization: Literal["sync", "async"] = "sync"
    kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to gymnasium.make")
    options: dict[str, Any] = Field(default_factory=dict, description="the adapter's own options (e.g. minigrid: "
                                                                       "tile_size, view); the adapter checks them")
    eval_envs: int = Field(10, ge=1, le=1024, description="envs (one episode each) used for evaluation")
    action_chunk: int = Field(1, ge=1, le=256, description="primitive actions per policy decision: >1 makes each "
                                                           "step execute a chunk of actions (VLA policies)")
    eval_options: dict[str, Any] = Field(default_factory=dict, description="options that differ for evaluation, "
                                                                           "over options (e.g. split: held_out)")

    @field_validator("kwargs")
    @classmethod
    def _headless(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        mode = kwargs.get("render_mode")
        if mode is not None and mode not in HEADLESS_RENDER_MODES:
            raise ValueError(f"env.kwargs.render_mode={str(mode)[:40]!r} would open a window, and env services run "
                             f"headless. Fix: leave it out, or use one of {list(HEADLESS_RENDER_MODES)}")
        return kwargs


class CNNConfig(_Strict):
    """The conv stack of image observations (uint8 Box of rank 3): one entry per layer."""

    channels: list[int] = Field(default_factory=lambda: [32, 64, 64])
    kernels: list[int] = Field(default_factory=lambda: [8, 4, 3])
    strides: list[int] = Field(default_factory=lambda: [4, 2, 1])
    features: int = Field(512, ge=1, le=65536, description="units of the linear layer after the convolutions")

    @model_validator(mode="after")
    def _layers(self) -> CNNConfig:
        if not (len(self.channels) == len(self.kernels) == len(self.strides)) or not self.channels:
            raise ValueError("channels, kernels and strides need one entry per conv layer, e.g. channels: [16, 32], "
                             "kernels: [3, 3], strides: [2, 1]")
        if any(v <= 0 for v in [*self.channels, *self.kernels, *self.strides]):
            raise ValueError("channels, kernels and strides must be positive")
        return self


class LMConfig(Options):
    """A causal language model (policies ``causal_lm``): a transformers architecture built from these sizes and
    randomly initialised, or a saved local directory (``path``). Never fetched from a hub."""

    paths: ClassVar[dict[str, tuple[str, ...]]] = {"model": ("path",), "data": ("tokenizer_corpus",)}

    arch: Literal["llama", "qwen2", "qwen3"] = Field("llama", description="the transformers architecture of a "
                                                                          "built model (ignored with a path)")
    hidden_size: int = Field(128, ge=8, le=65536)
    intermediate_size: int = Field(256, ge=8, le=262144)
    layers: int = Field(2, ge=1, le=256)
    heads: int = Field(2, ge=1, le=256, description="attention heads; hidden_size/heads is the head dim (vLLM on "
                                                    "CPU needs 64 or another size its kernels support)")
    max_positions: int = Field(256, ge=16, le=1 << 20)
    tie_embeddings: bool = False
    path: str = Field("", max_length=4096, description="a local Hugging Face checkpoint directory (config.json, "
                                                       "weights, its tokenizer with any chat template, "
                                                       "generation_config.json), e.g. a small Qwen2/Qwen3 or Llama; "
                                                       "empty builds the model from the sizes above")
    tokenizer: Literal["auto", "chars", "bpe"] = Field(
        "auto", description="the tokenizer of a built model: chars (one token per ASCII character), bpe (a "
                            "byte-level BPE trained on tokenizer_corpus at start-up), auto (bpe when "
                            "tokenizer_corpus is set, else chars); ignored with a path (the checkpoint's own)")
    vocab_size: int = Field(1024, ge=259, le=1 << 20, description="tokenizer bpe: its target vocabulary size in "
                                                                  "tokens (256 bytes + 3 specials at least; "
                                                                  "default 1024)")
    tokenizer_corpus: str = Field("", max_length=4096, description="tokenizer bpe: a local JSONL or Parquet file "
                                                                   "whose strings the tokenizer is trained on; "
                                                                   "empty: set from env.options.path for the text "
                                                                   "adapter's dataset task")
    gradient_checkpointing: bool = False
    attention: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "sdpa", description="transformers' attention implementation in the learner and the hf backend: sdpa "
                            "(torch's fused kernels), eager (matmul and softmax: on a CPU under runtime.precision "
                            "bf16-mixed its backward pass is ~25% faster at contexts of a few hundred tokens), "
                            "flash_attention_2 or flex_attention where installed (GPUs)")
    lora: LoRAConfig = Field(default_factory=LoRAConfig)

    @model_validator(mode="after")
    def _heads(self) -> LMConfig:
        if self.hidden_size % self.heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by heads={self.heads}")
        return self


class _PolicyShared(_Strict):
    """The ``policy`` section's own fields: what every policy may read (core's models read all of them)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    name: str = Field("", max_length=64, description="the policy to train (a registered name; one with options of "
                                                     "its own reads them from policy.<name>); empty: the one the "
                                                     "algorithm names")
    hidden_sizes: list[int] = Field(default_factory=lambda: [64, 64])
    activation: Literal["tanh", "relu"] = "tanh"
    log_std_init: float = 0.0
    ortho_init: bool = True
    cnn: CNNConfig = Field(default_factory=CNNConfig, description="encoder of image observations")
    lm: LMConfig = Field(default_factory=LMConfig, description="the language model of LM policies")
    init_checkpoint: str = Field("", max_length=4096, description="start from the policy weights of this checkpoint "
                                                                  "file (e.g. a supervised warm start's); empty: fresh init")

    @model_validator(mode="after")
    def _positive_sizes(self) -> _PolicyShared:
        if not self.hidden_sizes or any(h <= 0 for h in self.hidden_sizes):
            raise ValueError("hidden_sizes must be a non-empty list of positive integers, e.g. [64, 64]")
        return self

    def extension_sections(self) -> dict[str, Options]:
        """Every options section by name: each policy's (``policy.<name>``) and core's ``lm``, the ones that may
        declare paths and code (services/core/options.py)."""
        return {name: value for name in type(self).model_fields
                if isinstance(value := getattr(self, name), Options)}


# One section per registered policy options model (rlfabric.policy_options entry points: rlfabric's model families
# and any installed package's), named after its policy: config.policy.<name>.<option>.
PolicyConfig = create_model("PolicyConfig", __base__=_PolicyShared, __module__=__name__,
                            **option_sections(POLICY_OPTIONS, "policy", _PolicyShared.model_fields))
PolicyConfig.__doc__ = ("The policy section: the fields every policy may read, and one options section per "
                        "registered policy (policy.<name>).")


def _algorithm_field() -> tuple[Any, Any]:
    """The ``algorithm`` section's type: a union of every registered algorithm's config, tagged by ``name`` (so an
    error names the field inside the chosen algorithm), defaulting to the algorithm marked default."""
    specs = load_algorithms()
    configs = tuple(spec.Config for spec in specs.values())
    union = configs[0] if len(configs) == 1 else Annotated[Union[configs], Field(discriminator="name")]  # noqa: UP007
    defaults = [spec for spec in specs.values() if spec.default]
    first = defaults[0] if defaults else next(iter(specs.values()))
    return union, first.Config


AlgorithmSection, _DefaultAlgorithm = _algorithm_field()


class TrainConfig(_Strict):
    total_env_steps: int = Field(100_000, ge=1)
    eval_every_iterations: int = Field(10, ge=0, description="0 disables periodic evaluation")
    eval_episodes: int = Field(10, ge=1, le=10_000)
    stop_at_eval_return: float | None = Field(None, description="stop early once eval mean return reaches it")
    eval_deterministic: bool = Field(True, description="evaluate with the policy's mode (argmax or mean); false "
                                     "samples its actions, as training does: argmax policies can loop where "
                                     "their samples succeed (grid worlds such as MiniGrid). Periodic and final "
                                     "evaluation, stop_at_eval_return and rlfabric eval's default follow it")
    held_out_episodes: int = Field(
        0, ge=0, le=100_000,
        description="after the last iteration, one more evaluation of this many episodes on scenes no periodic "
                    "evaluation replays (env seeds from seed + 1,000,000): held_out_success_rate and "
                    "held_out_return_mean in a last metrics row. Periodic evaluations re-seed the same eval_envs "
                    "scenes each time, so one scene set's luck runs through their whole curve; 0: none")
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
    snapshot_bytes: int = Field(1 << 30, ge=1, description="host memory the learner may hold in published weight "
                                                            "versions (always at least the newest one)")


class ReplayConfig(_Strict):
    store: Literal["memory", "redis"] = "memory"
    capacity_transitions: int = Field(1_000_000, ge=1, description="rows each replay source keeps; the oldest go "
                                                                   "first")
    capacity_bytes: int | None = Field(None, ge=1 << 20, description="memory store: bytes each source keeps, the "
                                       "oldest batches going first; all sources together at most the replay "
                                       "service's --max-memory-bytes (default: that budget split evenly over the "
                                       "run's sources)")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="used when store is redis")
    key_prefix: str = Field("rlfabric", description="Redis keys live under <key_prefix>:<run_id>:")
    connect_timeout_s: float = Field(5.0, gt=0)
    retry_attempts: int = Field(5, ge=0, description="bounded retries when Redis is lost mid-run")
    retry_backoff_s: float = Field(0.2, ge=0)
    offload_bytes: int = Field(1 << 20, ge=1024,
                               description="tensors larger than this go to the object store by reference")
    datasets: dict[str, str] = Field(
        default_factory=dict, description="named replay sources loaded from data set files at the start of a run "
                                          "(e.g. offline: demos.npz); kept across resumes")

    @model_validator(mode="after")
    def _sources(self) -> ReplayConfig:
        for name in self.datasets:
            if not name or len(name) > 64 or not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(f"replay.datasets source name {name!r}: use letters, digits, '-' and '_'")
        return self


class _RolloutShared(_Strict):
    """The ``rollout`` section's own fields: what every collector and backend may read."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    collector: str = Field("auto", max_length=300,
                           pattern=r"^[A-Za-z_][A-Za-z0-9_.]*(:[A-Za-z_][A-Za-z0-9_.]*)?$",
                           description="how rollout workers act (services/rollout/collectors): auto takes the "
                                       "collector the env adapter declares (gym stepping for gymnasium envs), "
                                       "an rlfabric.collectors entry point, or package.module:Class")
    backend: str = Field("torch", max_length=300, pattern=r"^[A-Za-z_][A-Za-z0-9_.]*(:[A-Za-z_][A-Za-z0-9_.]*)?$",
                         description="inference backend (services/rollout/backends): torch; hf or vllm for "
                                     "language-model policies; an rlfabric.backends entry point, or "
                                     "package.module:Class")
    temperature: float = Field(1.0, gt=0, le=10, allow_inf_nan=False,
                               description="LM sampling temperature (log-probs are of the tempered distribution)")
    max_new_tokens: int = Field(16, ge=1, le=1 << 16, description="LM tokens generated per turn at most")
    finish_fraction: float = Field(
        1.0, gt=0, le=1, allow_inf_nan=False,
        description="LM over-sampling: a generation round ends once this fraction of the shard's groups have "
                    "finished; the long tail still generating is aborted and its groups are dropped from the update "
                    "(set num_envs to the groups you want trained / this). Engines that stream (vllm) cut; hf "
                    "generates every row to the end")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="the inference engine's weights and arithmetic (hf, vllm, sglang): auto is float32 on "
                            "CPUs (the learner's own numbers) and the checkpoint's dtype on GPUs; bfloat16 on a CPU "
                            "with AMX (Xeon 4th gen+) generates ~1.8x faster, and its log-probs then differ from an "
                            "fp32 learner's (logprob_mismatch_abs)")
    engine_memory_fraction: float | None = Field(None, gt=0, le=1, allow_inf_nan=False,
                                                 description="share of device memory (host memory on CPU) an "
                                                             "inference engine reserves; default: 0.1 on CPU, the "
                                                             "engine's own on GPUs")

    def extension_sections(self) -> dict[str, Options]:
        """Every backend's options section (``rollout.<name>``) with its backend's name."""
        return {name: value for name in type(self).model_fields
                if isinstance(value := getattr(self, name), Options)}


# One section per registered backend options model (rlfabric.backend_options entry points), named after its
# backend: config.rollout.<backend>.<option>.
RolloutConfig = create_model("RolloutConfig", __base__=_RolloutShared, __module__=__name__,
                             **option_sections(BACKEND_OPTIONS, "rollout", _RolloutShared.model_fields))
RolloutConfig.__doc__ = ("The rollout section: the fields every collector and backend may read, and one options "
                         "section per registered backend (rollout.<name>).")


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
    max_message_bytes: int = Field(256 * 2**20, ge=1024, le=2**31, description="the largest data-plane message "
                                   "a service of the run accepts (at most 2 GiB: each one is held in memory whole)")
    timeout_s: float = Field(30.0, gt=0, description="how long a data-plane request waits for its peer")
    high_water_mark: int = Field(64, ge=1)


class RuntimeConfig(_Strict):
    torch_threads: int = Field(1, ge=1, le=256)
    precision: Literal["fp32", "bf16-mixed"] = Field(
        "fp32", description="the learner's arithmetic: fp32, or bf16-mixed (forward and backward passes under "
                            "torch.autocast in bfloat16; weights, optimizer state, log-softmax and losses stay fp32). "
                            "bf16-mixed is ~1.7x faster on CPUs with AMX or AVX512-BF16 and on recent GPUs")
    device: str = Field(
        "cpu", pattern=r"^(cpu|auto|cuda(:[0-9]{1,3})?)$",
        description="where learner and rollout models live: cpu, cuda, cuda:N, or auto (cuda where the host has "
                    "one, else cpu); each worker resolves it on its own host")
    worker_wait_s: float = Field(60.0, gt=0, description="how long a run waits for workers to register")
    liveness_s: float = Field(
        30.0, gt=0, le=86400, description="how long a worker in a Train or Collect call may show no progress (no "
                                          "compute, no data-plane messages, as its heartbeats report) beyond "
                                          "data_plane.timeout_s before it counts as stalled and the run recovers "
                                          "without it. A call's length never counts: only silence does")
    max_recoveries: int = Field(
        5, ge=0, le=1000, description="lost workers (killed, crashed, unreachable) a run recovers from: it re-places "
                                      "the work on live or restarted workers and resumes from the learner's newest "
                                      "state; 0 = the first loss fails the run")
    learner_ranks: int = Field(
        1, ge=1, le=64, description="torch.distributed ranks of the learner (FSDP2 data parallelism): the learner "
                                    "service starts ranks 1..N-1 on its host, or across hosts (learner_ranks_per_"
                                    "host); gloo on CPU, NCCL with one GPU per rank")
    learner_ranks_per_host: int = Field(
        0, ge=0, le=64, description="ranks on each of the learner's hosts (torchrun's nproc-per-node): 0 = all of "
                                    "learner_ranks on the learner's own host. Fewer: ranks 0..G-1 there, G..2G-1 on "
                                    "the first rank host the learner's operator gave it (serve learner --rank-hosts), "
                                    "and so on; learner_ranks must be a multiple of it")


class VisionStageConfig(_Strict):
    """Grounding pretraining of the policy's image encoder before imitation (services/policies/grounding.py): a
    read-out of its tokens regresses the env's scene_state() (where things are) from its camera images."""

    scenes: int = Field(0, ge=0, le=1_000_000, description="scenes of the env (resets) to learn from, a tenth held "
                                                           "out to report the error; 0: no vision stage")
    updates: int = Field(3000, ge=1, le=10_000_000, description="gradient steps")
    batch_size: int = Field(64, ge=1, le=65536, description="scenes per step")
    learning_rate: float = Field(1e-3, gt=0, allow_inf_nan=False, description="Adam's step size")


class WarmStartConfig(_Strict):
    """Stages the coordinator runs as the first part of this run when ``policy.init_checkpoint`` is empty
    (services/coordinator/warm_start.py; RLinf's supervised-then-RL recipe as one run, from the CLI or a notebook
    alike): optionally the policy's image encoder pretrained to localise first,
    then demonstrations by the env's scripted expert and/or from a LeRobot data set, and a supervised run on them,
    whose checkpoint this run starts from. Each stage leaves its own directory under ``<run dir>/warm_start``; the
    supervised stage keeps the run's env, policy and train sections (its evaluations follow
    train.eval_every_iterations) on the default plan."""

    demos: int = Field(0, ge=0, le=1_000_000, description="episodes of the env's scripted expert to record (as "
                                                           "rlfabric collect --expert); 0: no demonstrations")
    demos_seed: int = Field(2_000_000_000, ge=0, le=2**32 - 1, description="env seed of the first demonstration "
                            "and of the vision stage's first scene: its scenes must not be the ones the run "
                            "evaluates on (seed + 100000 on), or evaluation measures recall of the training set")
    dataset: str = Field("", max_length=4096, description="a LeRobot data set's directory (format v2.x or v3.0) "
                         "whose episodes the supervised stage learns from too, turned into the env's observations "
                         "and action chunks (as rlfabric import-lerobot); empty: none")
    dataset_keys: dict[str, str] = Field(default_factory=dict, description="which LeRobot feature feeds which env "
                                         "observation entry ({image: observation.images.top}); unnamed entries are "
                                         "matched by name")
    dataset_episodes: int = Field(0, ge=0, le=10_000_000, description="import the data set's first N episodes; "
                                                                      "0: all")
    vision: VisionStageConfig = Field(default_factory=VisionStageConfig, description="first, the policy's image "
                                      "encoder learns where things are from the env's scene_state(); it then starts "
                                      "the policy's (policy.<name>.vlm_path; pair it with freeze_vision)")
    supervised: dict[str, Any] = Field(default_factory=dict, description="the supervised stage's algorithm section "
                                       "(an offline algorithm that imitates, with its fields); it learns from the "
                                       "demonstrations. Empty: no warm start")

    @model_validator(mode="after")
    def _offline_stage(self) -> WarmStartConfig:
        if not self.supervised:
            if self.demos or self.dataset:
                raise ValueError("warm_start.demos and warm_start.dataset are demonstrations for a supervised stage, "
                                 "and warm_start.supervised is empty. Fix: add warm_start.supervised: {name: ..., "
                                 "...} (an offline algorithm that imitates), or set demos: 0 and dataset: ''")
            return self
        if not self.demos and not self.dataset:
            raise ValueError("warm_start.supervised learns from demonstrations. Fix: warm_start.demos: N episodes "
                             "of the env's scripted expert, or warm_start.dataset: a LeRobot data set's directory")
        from pydantic import TypeAdapter

        try:
            section = TypeAdapter(AlgorithmSection).validate_python(self.supervised)
        except ValidationError as exc:
            raise ValueError(f"warm_start.supervised is not an algorithm section: {exc.errors()[0]['msg']} (at "
                             f"{'.'.join(map(str, exc.errors()[0]['loc']))})") from None
        if ALGORITHMS[section.name].roles.rollout != "none":
            raise ValueError(f"warm_start.supervised.name={section.name!r} collects with a rollout; the supervised "
                             f"stage learns offline from the demonstrations. Fix: an offline algorithm that imitates")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.supervised or self.vision.scenes)


class RunConfig(_Strict):
    name: str = Field("run", min_length=1, max_length=100, description="names the run (its id starts with it)")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="numpy and torch seeds derive from it")
    env: EnvConfig = Field(default_factory=EnvConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    algorithm: AlgorithmSection = Field(default_factory=_DefaultAlgorithm)  # type: ignore[valid-type]
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    data_plane: DataPlaneConfig = Field(default_factory=DataPlaneConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig, description="expert demonstrations and a "
                                        "supervised stage rlfabric train runs first, when policy.init_checkpoint "
                                        "is empty")

    @model_validator(mode="before")
    @classmethod
    def _default_algorithm(cls, data: Any) -> Any:
        """An algorithm section without a name is the default algorithm's (run specs may set only a few fields)."""
        if isinstance(data, dict) and isinstance(data.get("algorithm"), dict) and "name" not in data["algorithm"]:
            data = {**data, "algorithm": {"name": _DefaultAlgorithm.model_fields["name"].default, **data["algorithm"]}}
        return data

    @property
    def spec(self):
        """The algorithm spec class of this run (rlfabric.services.core.algorithm)."""
        return ALGORITHMS[self.algorithm.name]

    @property
    def policy_name(self) -> str:
        """The policy this run trains: ``policy.name``, or the one its algorithm names."""
        return self.policy.name or self.spec.policy

    @property
    def collects(self) -> bool:
        """Whether rollout workers collect data for this run's algorithm (offline algorithms do not)."""
        return self.spec.roles.rollout == "policy"

    def iterations(self) -> int:
        return self.spec.iterations(self)

    def progress(self) -> tuple[str, int]:
        """What progress counts: env steps, or iterations for an algorithm that collects nothing."""
        return ("env steps", self.train.total_env_steps) if self.collects else ("iterations", self.iterations())

    def import_paths(self) -> list[tuple[str, str]]:
        """(field, value) of every field that names code by its import path (``package.module:attr``), env.id
        also in gymnasium's ``module:EnvId`` form (gymnasium imports the module to find the id)."""
        named = [("env.adapter", self.env.adapter), ("env.id", self.env.id), ("policy.name", self.policy.name),
                 ("rollout.backend", self.rollout.backend), ("rollout.collector", self.rollout.collector)]
        for section in ("options", "eval_options"):
            reward = getattr(self.env, section).get("reward")
            if isinstance(reward, str):
                named.append((f"env.{section}.reward", reward))
        return [(f, v) for f, v in named if is_literal(v) or (f == "env.id" and ":" in v)]

    def code_options(self) -> list[str]:
        """The options sections' fields that are on and run a checkpoint's own code (``runs_code``: e.g. a VLM
        policy's ``policy.<name>.trust_remote_code``)."""
        return [f"{where}.{name}.{field}"
                for where, sections in (("policy", self.policy.extension_sections()),
                                        ("rollout", self.rollout.extension_sections()))
                for name, section in sections.items() for field in type(section).runs_code
                if getattr(section, field)]

    @model_validator(mode="after")
    def _code_by_import_path(self) -> RunConfig:
        """Before anything below resolves a name (a policy's check imports it): a service whose operator did not
        allow import paths refuses a spec that names code by one (services/core/registry.py says why)."""
        if not import_paths_allowed():
            for field, name in self.import_paths():
                raise refuse_import_path(field, name)
            for field in self.code_options():  # a checkpoint's own modeling code: the operator's choice too
                raise ValueError(f"{field}: true runs the checkpoint's own Python on this service, and this service "
                                 f"runs only installed code. Fix: leave it false (a transformers-native checkpoint "
                                 f"needs none), or have the operator start every service with {IMPORT_PATHS_FLAG}")
        return self

    @model_validator(mode="after")
    def _held_out_evaluation(self) -> RunConfig:
        """The warm start's scenes (env seeds demos_seed.. of the expert's envs and the vision stage's scenes) must
        not be the evaluation's or the first training batch's: with shared seeds an evaluation replays the very
        scenes the policy imitated, and its success rate measures memory, not skill."""
        warm = self.warm_start
        count = max(self.env.eval_envs if warm.demos else 0, warm.vision.scenes)
        if not count:
            return self
        taken = {"evaluation": (self.eval_seed(), self.env.eval_envs), "training": (self.seed, self.env.num_envs)}
        if self.train.held_out_episodes:
            taken["held-out evaluation"] = (self.held_out_seed(), self.env.eval_envs)
        default = WarmStartConfig.model_fields["demos_seed"].default
        for what, (first, n) in taken.items():
            if warm.demos_seed < first + n and first < warm.demos_seed + count:
                raise ValueError(
                    f"warm_start.demos_seed={warm.demos_seed} gives the warm start env seeds {warm.demos_seed}.."
                    f"{warm.demos_seed + count - 1}, which overlap the {what} env seeds {first}..{first + n - 1}: "
                    f"the run would evaluate or train on the scenes it imitated. Fix: a demos_seed outside both "
                    f"ranges (the default, {default}, is)")
        return self

    @model_validator(mode="after")
    def _tokenizer_corpus(self) -> RunConfig:
        """A built LM on a data-set task gets a tokenizer trained on that data set (config.yaml shows the file)."""
        lm, env = self.policy.lm, self.env
        if (env.adapter == "text" and env.id == "dataset" and not lm.path and not lm.tokenizer_corpus
                and lm.tokenizer != "chars" and isinstance(env.options.get("path"), str) and env.options["path"]):
            lm.tokenizer_corpus = env.options["path"]
        return self

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        sched = self.scheduling
        self.spec.check(self)
        if self.policy.name and self.policy.name != self.spec.policy:
            from rlfabric.services.core.policy_names import (
                check_policy,  # torch-free: the coordinator validates specs
            )

            check_policy(self.policy.name, self.spec.policy, f"algorithm {self.algorithm.name!r}")
        per_host = self.runtime.learner_ranks_per_host
        if per_host and self.runtime.learner_ranks % per_host:
            raise ValueError(f"runtime.learner_ranks={self.runtime.learner_ranks} is not a whole number of hosts of "
                             f"runtime.learner_ranks_per_host={per_host} ranks. Fix: a multiple of it, or "
                             f"learner_ranks_per_host: 0 (every rank on the learner's host)")
        if self.runtime.learner_ranks > 1:
            if not self.spec.data_parallel:
                raise ValueError(f"runtime.learner_ranks={self.runtime.learner_ranks}, but algorithm "
                                 f"{self.algorithm.name!r} does not split its update over ranks. Fix: "
                                 f"runtime.learner_ranks: 1")
            if sched.offload != "off":
                raise ValueError("scheduling.offload moves one learner's state; with runtime.learner_ranks > 1 the "
                                 "state is sharded over the ranks already. Fix: scheduling.offload: off")
        if not self.collects:
            return self
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

    def held_out_seed(self) -> int:
        """The final held-out evaluation's env seeds start here: apart from training's and the periodic
        evaluations' (``train.held_out_episodes``)."""
        return self.seed + 1_000_000

    def batch_env_steps(self) -> int:
        """Env steps one iteration collects (0 for an algorithm that collects nothing)."""
        return self.spec.steps_per_env(self.algorithm) * self.env.num_envs

    def to_json(self) -> str:
        return self.model_dump_json()

    def secrets(self) -> list[str]:
        """The fields of this spec that hold a secret (S3 keys, a password in replay.redis_url)."""
        named = [f"storage.{k}" for k in ("access_key", "secret_key") if getattr(self.storage, k)]
        return named + (["replay.redis_url"] if _url_password(self.replay.redis_url) else [])

    def redacted(self) -> RunConfig:
        """This spec without its secrets: what run files (config.yaml), the run index and logs hold, and what a
        worker that opens no store is sent. A run resumed from it takes the secrets from its workers' environment
        ($RLFABRIC_S3_ACCESS_KEY / $RLFABRIC_S3_SECRET_KEY, $RLFABRIC_REDIS_PASSWORD) or from ``--set`` again."""
        if not self.secrets():
            return self
        storage = self.storage.model_copy(update={"access_key": "", "secret_key": ""})
        replay = self.replay.model_copy(update={"redis_url": _without_password(self.replay.redis_url)})
        return self.model_copy(update={"storage": storage, "replay": replay})

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        try:
            return cls.model_validate(json.loads(text))
        except (ValidationError, json.JSONDecodeError) as exc:
            raise ConfigError(_explain(exc, "config_json")) from None


def _url_password(url: str) -> bool:
    try:
        return urlsplit(url).password is not None
    except ValueError:  # an unparseable URL may still hold one: treat it as secret
        return "@" in url


def _without_password(url: str) -> str:
    """A URL as a run file may hold it: the user name kept, the password dropped (the whole URL when it does not
    parse, since a password could hide in it)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:
        return ""
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}@{host}" if parts.username else host))


def _resolve(loc: tuple) -> tuple[tuple, list[Any]]:
    """(the location as a user writes it, the models along it). Errors inside the algorithm section carry the
    algorithm's tag (``algorithm.<name>.n_epochs``); users write ``algorithm.n_epochs``."""
    shown: list[str] = []
    models: list[Any] = [RunConfig]
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        shown.append(part)
        current = models[-1]
        if current is RunConfig and part == "algorithm" and parts and parts[0] in ALGORITHMS:
            models.append(ALGORITHMS[parts.pop(0)].Config)
            continue
        field = getattr(current, "model_fields", {}).get(part)
        models.append(field.annotation if field is not None else None)
    return tuple(shown), models


def _fields_at(loc: tuple) -> list[str]:
    """Names valid where the last part of ``loc`` sits, to suggest the closest one for a typo."""
    _, models = _resolve(loc)
    return list(getattr(models[-2], "model_fields", {}).keys()) if len(models) >= 2 else []


def _description_at(loc: tuple) -> str:
    """A field's documented meaning, where a bare list of allowed values would not say why."""
    shown, models = _resolve(loc)
    parent = models[-2] if len(models) >= 2 else None
    field = getattr(parent, "model_fields", {}).get(shown[-1]) if shown else None
    return (field.description or "") if field is not None else ""


def _explain(exc: Exception, source: str) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{source}: not valid JSON ({exc}). Fix: send RunConfig.to_json() output"
    assert isinstance(exc, ValidationError)
    lines = [f"{source}: {exc.error_count()} invalid field(s)"]
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        shown, _ = _resolve(loc)
        field = ".".join(shown) or "(top level)"
        got = err.get("input")
        if err["type"] == "extra_forbidden":
            valid = _fields_at(loc)
            close = difflib.get_close_matches(loc[-1], valid, n=1)
            hint = f"did you mean '{'.'.join(shown[:-1] + (close[0],))}'?" if close else f"valid keys: {', '.join(valid)}"
            lines.append(f"  {field}: unknown field. Fix: remove it; {hint}")
        elif err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            lines.append(f"  {field}.name: {got.get('name') if isinstance(got, dict) else got!r} is not a registered "
                         f"algorithm. Fix: set {field}.name to one of {', '.join(sorted(ALGORITHMS))}")
        elif err["type"] == "literal_error":
            why = _description_at(loc)
            lines.append(f"  {field}: {err['msg']} (got {got!r}). Fix: use one of the listed values"
                         + (f" ({field}: {why})" if why else ""))
        elif err["type"] == "missing":
            lines.append(f"  {field}: required. Fix: add it")
        elif not loc or (len(shown) == 1 and shown[0] == "algorithm" and err["type"] == "value_error"):
            lines.append(f"  {err['msg'].removeprefix('Value error, ')}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {field}: {msg} (got {got!r}). Fix: set {field} to a valid value")
    return "\n".join(lines)


def _old_algorithm_layout(data: dict[str, Any]) -> str | None:
    """Run specs once nested an algorithm's fields under its name (algorithm: {name: <name>, <name>: {...}})."""
    section = data.get("algorithm")
    if isinstance(section, dict):
        for key, value in section.items():
            if key in ALGORITHMS and isinstance(value, dict):
                return (f"algorithm.{key}: algorithm settings now sit directly under algorithm:. Fix: move the "
                        f"fields of algorithm.{key} up one level, next to algorithm.name (e.g. algorithm.n_steps)")
    return None


def parse_config(text: str, source: str = "config", overrides: list[str] | None = None) -> RunConfig:
    """Parse YAML text into a RunConfig, raising ConfigError with the field, the problem and the fix."""
    return _validate(read_spec(text, source, overrides), source)


def _validate(data: dict[str, Any], source: str) -> RunConfig:
    old = _old_algorithm_layout(data)
    if old:
        raise ConfigError(f"{source}: {old}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    path = Path(path)
    return _validate(read_spec_file(path, overrides), str(path))


def dump_yaml(config: RunConfig) -> str:
    return yaml.safe_dump(json.loads(config.to_json()), sort_keys=False)
