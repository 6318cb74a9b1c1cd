"""The options sections of rlfabric's model-family policies (``policy.<name>``), without torch: the coordinator
validates every run spec with them and never imports a policy. Each is registered beside its policy in rlfabric's
pyproject.toml (``rlfabric.policy_options``, as a plug-in's would be in its own; services/core/options.py), and
each policy reads its own section (``cfg.pi0``, ``cfg.vla_tokens``, ...)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rlfabric.services.core.options import LoRAConfig, PolicyOptions


class VLAConfig(PolicyOptions):
    """A VLA-shaped policy (``policy.name: vla``): image patches, instruction tokens and proprioception as tokens
    of one transformer trunk, and an action-chunk head."""

    serves: ClassVar[str | None] = "actor_critic"

    width: int = Field(64, ge=8, le=8192, description="token width of the trunk")
    heads: int = Field(4, ge=1, le=128)
    layers: int = Field(2, ge=1, le=64)
    patch: int = Field(8, ge=2, le=64, description="image patch size (pixels): one token per patch")
    encoder: Literal["cnn", "vit", "nature"] = Field(
        "cnn", description="image tokens from a conv stem (three stride-2 convolutions: patch 8), a ViT's linear patch "
                           "embedding, or nature: a Nature-CNN over the whole image (policy.cnn) whose features "
                           "become image_tokens tokens (RT-1's few-token image summary)")
    image_tokens: int = Field(4, ge=1, le=64, description="encoder nature: tokens the image features become")
    keypoints: int = Field(0, ge=0, le=256, description="spatial-softmax keypoints of the image (the expected "
                                                         "x, y of K feature maps) as one more token; 0: none")
    head: Literal["tokens", "flow"] = Field("tokens", description="tokens: discrete action tokens decoded in "
                                                                  "parallel; flow: a flow-matching action expert")
    bins: int = Field(21, ge=2, le=1024, description="tokens head: bins per action dimension over [low, high]")
    flow_steps: int = Field(4, ge=1, le=64, description="flow head: denoising steps per chunk")
    flow_noise: float = Field(0.5, gt=0, le=5, allow_inf_nan=False,
                              description="flow head: the Flow-SDE noise level sigma of each denoising step")
    logprob_level: Literal["chunk", "action", "token"] = Field(
        "chunk", description="what one log-prob covers in the update: the whole chunk, one action of it, or one "
                             "action dimension (token)")

    @model_validator(mode="after")
    def _heads(self) -> VLAConfig:
        if self.width % self.heads:
            raise ValueError(f"width={self.width} is not divisible by heads={self.heads}")
        if self.encoder == "nature" and self.keypoints:
            raise ValueError("keypoints read the image at full resolution beside per-patch tokens; with encoder: "
                             "nature set keypoints: 0")
        return self


class TinyVLMSizes(PolicyOptions):
    """The sizes a tiny PaliGemma is built from (random init) when a VLM policy loads no checkpoint: a Gemma
    language model with one KV head per layer and a SigLIP image encoder."""

    width: int = Field(64, ge=8, le=8192, description="hidden size of the VLM's language model")
    layers: int = Field(2, ge=1, le=64, description="layers of the language model (pi0: and of its expert, which "
                                                    "reads the VLM's KV cache layer by layer)")
    heads: int = Field(2, ge=1, le=128, description="attention heads of the language model (pi0: and its expert)")
    head_dim: int = Field(32, ge=4, le=512, description="width of one attention head (one KV head, as pi0)")
    vision_width: int = Field(64, ge=8, le=8192, description="hidden size of the SigLIP image encoder")
    vision_layers: int = Field(2, ge=1, le=64, description="layers of the SigLIP image encoder")
    patch: int = Field(16, ge=2, le=64, description="image patch size (pixels): one VLM token per patch")
    value_hidden: int = Field(64, ge=1, le=8192, description="hidden width of the value head (either critic)")
    freeze_vision: bool = Field(False, description="keep the image encoder's weights as they start (pretrained: "
                                                   "policy.pi0.vlm_path, warm_start.vision or a checkpoint): "
                                                   "imitation and RL train the rest, and a fresh action head's "
                                                   "gradients cannot overwrite what the encoder localises")
    critic: Literal["prefix", "own"] = Field(
        "prefix", description="what the value head reads: the mean of the VLM prefix's hidden states, or an encoder "
                              "of its own (policy.cnn per camera, the state, the instruction's ids; "
                              "services/policies/obs_critic.py), which localises what pooling loses")
    value_detach: bool = Field(False, description="the prefix critic reads the VLM's features without sending its "
                                                   "gradient back into the VLM: a critic learning from scratch on a "
                                                   "fine-tuned policy cannot disturb what the policy sees")


class PI0PolicyConfig(TinyVLMSizes):
    """transformers' pi0 (``policy.name: pi0``): a PaliGemma VLM reads the camera images and the instruction, and a
    flow-matching action expert reads its KV cache and denoises an action chunk. Built from the sizes below with
    random init, or loaded from ``path`` (a local ``save_pretrained`` directory; never downloaded)."""

    serves: ClassVar[str | None] = "actor_critic"
    paths: ClassVar[dict[str, tuple[str, ...]]] = {"model": ("path", "vlm_path")}

    path: str = Field("", max_length=4096, description="a local save_pretrained directory of a "
                                                       "PI0ForConditionalGeneration; empty: build from the sizes below")
    vlm_path: str = Field("", max_length=4096, description="a local save_pretrained directory that starts the VLM "
                          "of a pi0 built from the sizes: a PaliGemma VLM (every tensor whose name and shape agree, "
                          "as pi0 starts from PaliGemma) or a SigLIP vision model (the image encoder alone, e.g. "
                          "warm_start.vision's); empty: random init")
    expert_width: int = Field(64, ge=8, le=8192, description="hidden size of the action expert")
    image_size: int = Field(0, ge=0, le=1024, description="the size images are resized to; 0: the env's own")
    flow_steps: int = Field(4, ge=1, le=64, description="denoising steps per chunk (each one an expert call)")
    flow_noise: float = Field(0.5, gt=0, le=5, allow_inf_nan=False,
                              description="the Flow-SDE noise level sigma of each denoising step when sampling "
                                          "(sde_steps: last: the std of the last step's noise, in [-1, 1] units)")
    sde_steps: Literal["all", "last"] = Field(
        "all", description="which denoising steps draw noise when sampling for RL: all (Flow-SDE over the whole "
                           "chain), or last (the first K-1 follow the ODE from the recorded x_0; the update re-runs "
                           "them). last: every scored noise dimension moves the executed chunk; on ArmReachLang the "
                           "signal-to-noise of its policy gradient with per-chunk rewards was 4x (bench/pg_snr.py)")
    logprob_level: Literal["chunk", "action", "token"] = Field(
        "chunk", description="what one log-prob covers in the update: the whole chunk, one action of it, or one "
                             "action dimension")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA adapters (peft) on the attention "
                             "projections named in lora.targets; rank 0 trains every parameter")
    lora_on: Literal["vlm", "expert", "both"] = Field("both", description="where the adapters go: the VLM's language "
                                                     "model, the action expert, or both (the action and state "
                                                     "projections always train in full)")

    @model_validator(mode="after")
    def _one_start(self) -> PI0PolicyConfig:
        if self.path and self.vlm_path:
            raise ValueError("policy.pi0.path loads a whole pi0 and policy.pi0.vlm_path starts the VLM of one built "
                             "from the sizes. Fix: set one of them")
        return self


class VLMPolicyConfig(TinyVLMSizes):
    """A policy on a transformers image-text-to-text VLM (PaliGemma, SmolVLM/Idefics3 or Qwen2.5-VL): built tiny
    from the sizes (random init, of ``family``), or loaded from ``path`` (a local ``save_pretrained`` directory,
    whose config says its family; never downloaded). As ``policy.vlm`` (``policy.name: vlm``) it writes text:
    captions or answers about its images."""

    serves: ClassVar[str | None] = "actor_critic"  # (its actions are the text's token ids)
    paths: ClassVar[dict[str, tuple[str, ...]]] = {"model": ("path", "vlm_path")}
    runs_code: ClassVar[tuple[str, ...]] = ("trust_remote_code",)

    family: Literal["paligemma", "smolvlm", "qwen2_5_vl"] = Field(
        "paligemma", description="the family a tiny model is built as: paligemma (SigLIP patches, a Gemma whose "
                                 "prefix attends both ways), smolvlm (pixel-shuffled SigLIP patches, a causal Llama) "
                                 "or qwen2_5_vl (merged ViT patches, a causal Qwen2 with M-RoPE); a loaded path's own "
                                 "config decides")
    path: str = Field("", max_length=4096, description="a local save_pretrained directory of a PaliGemma or SmolVLM "
                                                       "VLM; empty: build a tiny one from the sizes")
    vlm_path: str = Field("", max_length=4096, description="a local save_pretrained directory that starts a tiny "
                          "PaliGemma built from the sizes: a PaliGemma VLM (every tensor whose name and shape agree) "
                          "or a SigLIP vision model (the image encoder alone, e.g. warm_start.vision's); empty: "
                          "random init")
    trust_remote_code: bool = Field(False, description="allow a checkpoint's own modeling code (local files only)")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA adapters (peft) on the modules named in "
                             "lora.targets, vision tower included; rank 0 trains every parameter")

    @model_validator(mode="after")
    def _one_start(self) -> VLMPolicyConfig:
        if self.path and self.vlm_path:
            raise ValueError("path loads a whole VLM and vlm_path starts one built from the sizes. Fix: set one "
                             "of them")
        if self.vlm_path and self.family != "paligemma":
            raise ValueError(f"vlm_path starts a PaliGemma (a SigLIP image encoder), and family={self.family!r}. "
                             f"Fix: family: paligemma")
        return self


class VLATokensConfig(VLMPolicyConfig):
    """An OpenVLA-style policy (``policy.name: vla_tokens``): a VLM whose action dimensions are tokens, ``bins``
    bins mapped onto the vocabulary's last ids."""

    bins: int = Field(256, ge=2, le=4096, description="bins per action dimension over [low, high], mapped onto "
                                                     "the vocabulary's last ids (OpenVLA: 256)")
    parallel: bool = Field(False, description="decode the whole chunk in one forward pass from learned action "
                                              "queries (OFT-style) instead of token by token")
    logprob_level: Literal["chunk", "action", "token"] = Field(
        "token", description="what one log-prob covers in the update: the whole chunk, one action, or one token")
    temperature: float = Field(1.0, gt=0, le=10, allow_inf_nan=False, description=(
        "RL's sampling temperature: the rollouts sample, and the learner scores, softmax(logits / temperature) over "
        "the bins. Above 1 it explores bins a supervised start has made unlikely; deterministic acting (the argmax) "
        "and imitation (the bins' cross-entropy) are unaffected"))
    imitation_sigma: float = Field(0.0, ge=0, le=64, allow_inf_nan=False, description=(
        "imitation's target over the bins: 0 puts all of it on the demonstrated action's nearest bin "
        "(OpenVLA); above 0 it is a Gaussian, this many bins wide, centred on the demonstrated action, so "
        "the imitating policy keeps the neighbouring bins probable in proportion to their distance and RL's "
        "samples explore nearby actions (a little faster, a little to the side) instead of the one bin a "
        "one-hot target leaves. The argmax stays the nearest bin"))


class FlowActorConfig(PolicyOptions):
    """A flow-matching actor for off-policy continuous control (``policy.name: flow_actor``): K noisy Euler steps
    from Gaussian noise to a tanh-squashed action, differentiated end to end. Its MLPs use ``policy.hidden_sizes``
    and ``policy.activation``."""

    serves: ClassVar[str | None] = "flow_chain"

    steps: int = Field(4, ge=1, le=64, description="Euler steps K from noise to action (each one a forward of the "
                                                   "velocity network, and a step the actor's gradient runs through)")
    velocity: Literal["gated", "plain"] = Field(
        "gated", description="gated (Zhang et al. 2025's Flow-G): each step moves x toward a candidate by a sigmoid gate, "
                             "which keeps the gradient through K steps bounded; plain: an unconstrained velocity "
                             "network (the flow policy as written, whose gradient through the chain can explode)")


class LatentNoiseConfig(PolicyOptions):
    """A policy that acts in the initial noise of a frozen flow policy (``policy.name: latent_noise``): a
    squashed-Gaussian actor over the noise (``policy.hidden_sizes``, ``policy.activation``) whose latent the base
    policy's denoising ODE decodes into the action chunk. The base is built from its own section (``policy.vla``
    with head flow, or ``policy.pi0``) and holds the weights its algorithm loads into it (from its
    ``expert_checkpoint``)."""

    serves: ClassVar[str | None] = "steered_noise"

    base: Literal["vla", "pi0"] = Field("vla", description="the frozen flow policy whose noise is steered (policy.vla "
                                                           "needs head: flow)")
    noise_bound: float = Field(1.5, gt=0, le=10, allow_inf_nan=False,
                               description="the latent's range [-noise_bound, noise_bound] per dimension: the base "
                                           "was trained on N(0, I) noise, so most of its mass is within 2; wider "
                                           "reaches chunks the base rarely makes")


__all__ = ["FlowActorConfig", "LatentNoiseConfig", "PI0PolicyConfig", "TinyVLMSizes", "VLAConfig", "VLATokensConfig", "VLMPolicyConfig"]
