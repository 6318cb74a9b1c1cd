"""A local stack takes the deployment's secret the way every service does: RLFABRIC_TOKEN_FILE first, then
RLFABRIC_TOKEN, else a new one of its own, so `rlfabric up` beside a gateway started with a token file reaches it."""

from __future__ import annotations

from rlfabric.services.core import auth
from rlfabric.services.launcher import LocalStack


def test_a_stack_reads_the_token_file_before_the_token_and_makes_one_without_either(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    made = LocalStack(tmp_path / "logs").token
    assert len(made) >= 32 and made != LocalStack(tmp_path / "logs").token  # a new one per stack
    monkeypatch.setenv(auth.TOKEN_ENV, "from-the-variable")
    assert LocalStack(tmp_path / "logs").token == "from-the-variable"
    path = auth.write_token_file(tmp_path / "token", "from-the-file")
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(path))
    assert LocalStack(tmp_path / "logs").token == "from-the-file"
    assert LocalStack(tmp_path / "logs", token="").token == ""  # an explicit choice wins
