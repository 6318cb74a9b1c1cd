"""LocalEnvChannel: the env pools of a run hosted inside the process that acts on them.

A placement choice for plans whose stages share a worker (collocated): the rollout talks to the same
``EnvPools`` protocol as over the data plane, minus the inter-process hop (~1 ms per step on 2 cores).
Requests are served when sent; answers are kept until received, as a DataClient would deliver them.
"""

from __future__ import annotations

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.dataplane import RemoteError
from rlfabric.services.env.pool import EnvPools


class LocalEnvChannel:
    peer = "env (in-process)"

    def __init__(self, config) -> None:
        self.pools = EnvPools(config, build_train=False)  # the worker's shard is built by its first reset
        self._seq = 0
        self._answers: dict[int, tuple[str, TensorBatch] | Exception] = {}

    def send(self, kind: str, batch: TensorBatch | None = None) -> int:
        batch = batch or TensorBatch()
        self._seq += 1
        try:
            out_kind, tensors = self.pools.handle(kind, batch.meta, batch.tensors)
            self._answers[self._seq] = (out_kind, TensorBatch(tensors, seq=self._seq))
        except ValueError as exc:  # the same refusal the env service would send back
            self._answers[self._seq] = RemoteError(f"env: '{kind}' refused: {exc}")
        return self._seq

    def recv(self, seq: int, timeout_s: float | None = None) -> tuple[str, TensorBatch]:
        answer = self._answers.pop(seq)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def request(self, kind: str, batch: TensorBatch | None = None,
                timeout_s: float | None = None) -> tuple[str, TensorBatch]:
        return self.recv(self.send(kind, batch))

    def close(self) -> None:
        self.pools.close()
