"""Bad input at every door (Python API, CLI, HTTP), API keys, concurrent turns of one conversation."""

import pytest

from ctxrelay.relay.api import ModelPool
from ctxrelay.relay.graph import Profile
from ctxrelay_bench.reliability import interfaces as doors


def test_python_api_refuses_bad_input_by_name(tiny_by_family, tmp_path):
    llama = tiny_by_family["llama"]
    c = doors.python_api(ModelPool([llama], artifact_dirs=[tmp_path], profile=Profile()), llama.name)
    assert c.clean, c.failures


def test_cli_prints_one_line_for_bad_input(tmp_path):
    # three cases here (a process each); the full bench's real-marked test runs all of them
    c = doors.cli(tmp_path, only=3)
    assert c.clean, c.failures


@pytest.fixture(scope="module")
def server(tiny_by_family, tmp_path_factory):
    llama, qwen = tiny_by_family["llama"], tiny_by_family["qwen2"]
    with doors.server(llama, qwen, tmp_path_factory.mktemp("http"), max_queue=2) as (url, _):
        yield url, llama.name, qwen.name


def test_http_answers_bad_input_and_bad_keys_with_4xx(server):
    url, sender, receiver = server
    c = doors.http_doors(url, sender, receiver)
    assert c.clean, c.failures


def test_concurrent_turns_of_one_conversation(server):
    url, sender, _ = server
    c = doors.concurrency(url, sender)
    assert c.clean, c.failures
    assert c.details["turn"].get("200", 0) >= 1 and c.details["stateless"].get("200", 0) >= 1


def test_a_full_disk_mid_command_prints_one_line_and_other_os_errors_still_raise(monkeypatch):
    import errno
    from types import SimpleNamespace

    import torch
    from typer.testing import CliRunner

    from ctxrelay import cli

    monkeypatch.delenv("CTXRELAY_DEBUG", raising=False)
    threads = torch.get_num_threads()  # the command sets them; the suite's stay

    def fails_with(code):
        def calibrate(*args, **kwargs):
            raise OSError(code, "simulated", "/cache/heterofold/moments.safetensors")

        return calibrate

    args = ["calibrate", "--transport", "heterofold", "--sender", "a", "--receiver", "b", "--threads", "1"]
    monkeypatch.setattr("ctxrelay.transports.get", lambda name: SimpleNamespace(calibrate=fails_with(errno.ENOSPC)))
    r = CliRunner().invoke(cli.app, args)
    assert r.exit_code == 1 and "no space left on the disk writing /cache/heterofold/moments.safetensors" in r.output
    assert "Traceback" not in r.output and "du -sh" in r.output
    monkeypatch.setattr("ctxrelay.transports.get", lambda name: SimpleNamespace(calibrate=fails_with(errno.EIO)))
    r = CliRunner().invoke(cli.app, args)
    torch.set_num_threads(threads)
    assert isinstance(r.exception, OSError) and r.exception.errno == errno.EIO  # a real I/O fault is not hidden
