"""env.adapter captions: an image-to-text data set (JSONL rows naming image files) as one-step episodes. Rows show
their images and prompt, a text is scored against the completion (word F1, exact match as is_success), seeded
evaluation reads every row once, the expert writes the completion, and bad rows and files outside the data roots
are refused naming the row and the fix."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlfabric.services.core.config import EnvConfig
from rlfabric.services.env.adapters import adapter
from rlfabric.services.env.adapters.captions import word_f1
from rlfabric.services.env.adapters.instruction import decode_instruction, encode_instruction

PIL = pytest.importorskip("PIL.Image")
CAPTIONS = ["red top", "blue top", "red bottom", "blue bottom", "green top"]


@pytest.fixture
def data(tmp_path):
    (tmp_path / "frames").mkdir()
    rows = []
    for i, text in enumerate(CAPTIONS):
        frame = np.full((20, 30, 3), 40 * i, np.uint8)
        PIL.fromarray(frame).save(tmp_path / "frames" / f"{i}.png")
        rows.append({"images": [f"frames/{i}.png"], "prompt": "where", "completion": text})
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def envs(path, n=2, **options):
    cfg = EnvConfig(adapter="captions", id=str(path), options={"image_size": 16, "max_tokens": 16, **options})
    return adapter("captions").make_vector_env(cfg, n)


def test_rows_show_their_image_and_prompt_and_texts_are_scored(data):
    v = envs(data)
    obs, _ = v.reset(seed=0)
    assert obs["image"].shape == (2, 16, 16, 3) and obs["image"].dtype == np.uint8
    assert obs["image"][0].mean() == 0 and obs["image"][1].mean() == 40  # rows 0 and 1, resized
    assert [decode_instruction(p) for p in obs["instruction"]] == ["where", "where"]
    texts = np.stack([encode_instruction("red top", 16), encode_instruction("blue", 16)])
    _, reward, terminated, _, info = v.step(texts)
    final = info["final_info"]  # one-step episodes: the vector env has already reset them (same-step)
    assert terminated.all() and final["is_success"].tolist() == [True, False]
    assert reward[0] == 1.0 and reward[1] == pytest.approx(word_f1("blue", "blue top")) and 0 < reward[1] < 1
    assert [e.expert_action().tolist() for e in v.envs] == [encode_instruction(t, 16).tolist()
                                                             for t in ("red bottom", "blue bottom")]  # next rows


def test_a_seeded_evaluation_reads_every_row_once(data):
    v = envs(data, n=2)
    seen = []
    obs, _ = v.reset(seed=10)
    for _ in range(3):
        seen += [int(o.mean()) // 40 for o in obs["image"]]
        obs, *_ = v.step(np.zeros((2, 16), np.int64))
    assert sorted(seen[:5]) == [0, 1, 2, 3, 4]


def test_word_f1_gives_partial_credit():
    assert word_f1("red top, blue bottom", "red top, blue bottom") == 1.0
    assert word_f1("red top, blue top", "red top, blue bottom") == pytest.approx(0.75)
    assert word_f1("", "red top") == 0.0 and word_f1("", "") == 1.0


@pytest.mark.parametrize("row, message", [
    ({"prompt": "where", "completion": "x"}, "needs 'images'"),
    ({"images": ["frames/0.png"], "completion": "x"}, "'prompt'"),
    ({"images": ["frames/nope.png"], "prompt": "where", "completion": "x"}, "cannot be read"),
    ({"images": ["frames/0.png"], "prompt": "where", "completion": "x" * 40}, "env.options.max_tokens"),
])
def test_bad_rows_name_the_row_and_the_fix(data, row, message):
    bad = data.parent / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=message) as exc:
        envs(bad, n=1)
    assert "row 0" in str(exc.value)


def test_images_outside_the_data_roots_are_refused(data, tmp_path_factory, monkeypatch):
    outside = tmp_path_factory.mktemp("elsewhere")
    PIL.fromarray(np.zeros((4, 4, 3), np.uint8)).save(outside / "secret.png")
    path = data.parent / "escape.jsonl"
    path.write_text(json.dumps({"image": str(outside / "secret.png"), "prompt": "p", "completion": "c"}) + "\n")
    monkeypatch.setenv("RLFABRIC_DATA_ROOT", str(data.parent))
    with pytest.raises(ValueError, match="row 0"):
        envs(path, n=1)
