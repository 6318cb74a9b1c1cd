"""The two warm-start stages that both VLA families' cautious-demonstrator recipes run first
(tests/e2e/test_cautious_demonstrator*.py), built once per checkout (tests/artefacts.py) instead of once per family:
the grounded image encoder (warm_start.vision) and the scripted expert's demonstrations (warm_start.demos). For a seed
they are the same bytes whichever family's spec builds them (checked on seed 0: docs/benchmarks.md), as they read only
the env, its scenes, the SigLIP sizes and the seed; ``inputs`` keys each stage on exactly those, so two specs that
differ there build their own.

    python -m tests.vla_warm_stages {vision,demos} SPEC OUT [--set key=value ...]

writes ``OUT/vision`` or ``OUT/demos.npz`` as a learner's Learner.WarmStart does under ``<run>/warm_start``
(services/learner/warm_start.py, the same functions), where a run keeps the stages it finds done."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def inputs(stage: str, spec: str, sets: list[str]) -> dict:
    """What stage ``stage`` of the spec (with ``sets``) is built from."""
    from rlfabric.services.core.config import load_config

    config = load_config(spec, sets)
    env, warm = json.loads(config.env.model_dump_json()), config.warm_start
    if stage == "demos":
        return {"env": env, "demos": warm.demos, "demos_seed": warm.demos_seed}
    from rlfabric.services.policies.vlm_inputs import siglip_paligemma_config

    section = getattr(config.policy, config.policy_name)
    size = getattr(section, "image_size", 0) or env["kwargs"]["image_size"]
    return {"env": env, "vision": json.loads(warm.vision.model_dump_json()), "demos_seed": warm.demos_seed,
            "seed": config.seed, "encoder": siglip_paligemma_config(section, 2, size)["vision_config"]}


def main(argv: list[str]) -> int:
    from rlfabric.services.core.config import load_config
    from rlfabric.services.learner import warm_start

    stage, spec, out, sets = argv[0], argv[1], Path(argv[2]), argv[4::2]
    done = (warm_start.vision if stage == "vision" else warm_start.demos)(load_config(spec, sets), out)
    print(done.summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
