"""Bad input at every door (Python API, CLI, HTTP), API keys, concurrent turns of one conversation,
and a checkpoint swapped under its artifact."""

import logging

import pytest

from ctxrelay.bench import reliability_doors as doors
from ctxrelay.models.tiny import tiny_model
from ctxrelay.relay.api import ModelPool
from ctxrelay.relay.graph import Profile


def clean(c) -> None:
    assert c.cases > 0 and c.requests > 0
    assert (c.requests_failed, c.unhandled) == (0, 0), c.failures


def test_python_api_refuses_bad_input_by_name(tiny_by_family, tmp_path):
    llama = tiny_by_family["llama"]
    clean(doors.python_api(ModelPool([llama], artifact_dirs=[tmp_path], profile=Profile()), llama.name))


def test_cli_prints_one_line_for_bad_input(tmp_path):
    clean(doors.cli(tmp_path, only=3))


@pytest.mark.real  # one process per case (~3 s each)
def test_cli_every_bad_input(tmp_path):
    c = doors.cli(tmp_path)
    clean(c)
    assert c.cases == len(doors.cli_cases(tmp_path))


@pytest.fixture(scope="module")
def server(tiny_by_family, tmp_path_factory):
    llama, qwen = tiny_by_family["llama"], tiny_by_family["qwen2"]
    with doors.server(llama, qwen, tmp_path_factory.mktemp("http"), max_queue=2) as (url, _):
        yield url, llama.name, qwen.name


def test_http_answers_bad_input_and_bad_keys_with_4xx(server):
    url, sender, receiver = server
    clean(doors.http_doors(url, sender, receiver))


def test_concurrent_turns_of_one_conversation(server):
    url, sender, _ = server
    c = doors.concurrency(url, sender)
    clean(c)
    assert c.details["turn"].get("200", 0) >= 1 and c.details["stateless"].get("200", 0) >= 1


def test_a_swapped_checkpoint_is_refused_by_name(tiny_by_family, tmp_path, monkeypatch):
    logging.getLogger("ctxrelay").setLevel(logging.ERROR)
    c = doors.model_swap(tiny_by_family["llama"], tiny_model("llama", seed=1), tiny_by_family["qwen2"], tmp_path)
    clean(c)
    assert "not the checkpoint the cache's manifest records" in c.details["note"]
    assert any("different checkpoint" in s for s in c.details["skipped"])
