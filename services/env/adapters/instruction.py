"""A task's words as an observation entry: UTF-8 bytes shifted by one (0 pads) in an int64 ``instruction`` vector,
which VLA policies embed with a 257-token vocabulary (the space's ``high`` tells them its size). Shared by the
simulator adapters whose tasks come with an instruction (MetaWorld, gym-hil, LIBERO)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

VOCAB_HIGH = 256  # the largest id: a byte (255) shifted by one


def encode_instruction(text: str, length: int = 32) -> np.ndarray:
    raw = text.encode()
    if len(raw) > length:
        raise ValueError(f"instruction {text!r} has {len(raw)} bytes, more than the {length} its entry holds")
    out = np.zeros(length, np.int64)
    out[:len(raw)] = np.frombuffer(raw, np.uint8).astype(np.int64) + 1
    return out


def decode_instruction(ids: np.ndarray, errors: str = "strict") -> str:
    """The text back from an ``instruction`` entry (padding dropped); ``errors`` as bytes.decode takes it."""
    ids = np.asarray(ids).reshape(-1)
    return bytes(int(i) - 1 for i in ids if 0 < i <= VOCAB_HIGH).decode(errors=errors)


class Instruction(gym.ObservationWrapper):
    """The task's instruction as an int64 ``instruction`` entry (the same every step of the sub-env's task); a
    non-Dict observation becomes the Dict's ``image``."""

    def __init__(self, env: gym.Env, text: str, length: int = 32):
        super().__init__(env)
        self.tokens, self.length = encode_instruction(text, length), length
        space = env.observation_space
        spaces = dict(space.spaces) if isinstance(space, gym.spaces.Dict) else {"image": space}
        spaces["instruction"] = gym.spaces.Box(0, VOCAB_HIGH, (length,), np.int64)
        self.observation_space = gym.spaces.Dict(spaces)

    def encode_instruction(self, text: str) -> np.ndarray:
        """Any task's words as this env's ``instruction`` entry (a data set's task text, for one)."""
        return encode_instruction(text, self.length)

    def observation(self, obs: Any) -> dict[str, Any]:
        out = dict(obs) if isinstance(obs, dict) else {"image": obs}
        out["instruction"] = self.tokens.copy()
        return out
