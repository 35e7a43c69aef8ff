"""The CLI's `--set` keys: each command lists its keys (`--keys`), a mistyped key exits with the valid ones
before any model loads, and the sub-command forms (`calibrate heterofold refit`, `bench report NAME`) make
the same calls as the `--set stage=` / `--set phase=report` forms that shipped manifests record.
Fast: no model runs (model loading is made to fail loudly)."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch
from typer.testing import CliRunner

from ctxrelay import cli, transports


@pytest.fixture(autouse=True)
def _no_models(monkeypatch):
    """Plain error lines (not tracebacks), the suite's torch threads kept, and any model load an error."""
    monkeypatch.delenv("CTXRELAY_DEBUG", raising=False)
    threads = torch.get_num_threads()

    def load(name, *args, **kwargs):
        raise AssertionError(f"a model was loaded: {name}")

    monkeypatch.setattr("ctxrelay.zoo.load", load)
    yield
    torch.set_num_threads(threads)


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args))


def error_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.strip()]


@pytest.mark.parametrize(
    ("transport", "valid"),
    [("heterofold", ("rank", "recompute_tokens", "stage", "chunk_chars")), ("mapflow", ("top_p", "essay_texts"))],
)
def test_an_unknown_calibrate_key_exits_with_the_valid_keys_before_any_model_loads(transport, valid):
    # the sender does not exist either: the key is what the command complains about, first
    r = invoke("calibrate", "--transport", transport, "--sender", "no-such-model", "--receiver", "no-such-either",
               "--set", "rnak=8", "--set", "epochs=1")  # fmt: skip
    assert r.exit_code in (1, 2), r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    lines = error_lines(r.output)
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    assert "rnak" in lines[0] and "valid keys" in lines[0]
    assert all(k in lines[0] for k in valid)


def test_a_stage_outside_its_choices_is_refused_before_any_model_loads():
    r = invoke("calibrate", "heterofold", "refti", "--sender", "no-such-model", "--receiver", "no-such-either")
    assert r.exit_code == 1 and "refti" in r.output and "refit" in r.output
    r = invoke("calibrate", "mapflow", "refit", "--sender", "a", "--receiver", "b")
    assert r.exit_code == 1 and "no stages" in r.output


@pytest.mark.parametrize("declared", [True, False])
def test_an_unknown_bench_key_exits_with_the_valid_keys(monkeypatch, declared):
    """The CLI checks a bench's declared keys; a bench's own check (bench_options) answers the same way."""
    if not declared:
        monkeypatch.delattr(cli.bench_module("reliability"), "TUNING_KEYS")
    r = invoke("bench", "reliability", "--set", "no_such_option=1")
    assert r.exit_code == 1, r.output
    lines = error_lines(r.output)
    assert len(lines) == 1 and "no_such_option" in lines[0]
    assert all(k in lines[0] for k in ("fuzz_cases", "tenant_cases", "kills", "contexts", "cli_cases"))


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (("calibrate", "--keys", "--transport", "heterofold"), ("stage", "refit", "recompute_tokens", "2048", "rank")),
        (("calibrate", "heterofold", "--keys"), ("own_layers", "hide_layers", "facts_cases")),
        (("calibrate", "mapflow", "--keys"), ("top_p", "0.9", "essay_texts", "modes")),
        (("bench", "decode", "--keys"), ("new_tokens", "128", "tokens decoded per timed run")),
        (("bench", "heterofold-frontier", "--keys"), ("phase", "both", "fractions")),
    ],
)
def test_keys_prints_each_key_with_its_default_and_meaning(args, shown):
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    assert "default" in r.output and "meaning" in r.output
    assert all(s in r.output for s in shown), r.output


@pytest.mark.parametrize("name", ["heterofold", "mapflow"])
def test_every_calibration_key_has_a_meaning_and_one_name(name):
    keys = transports.get(name).tuning_keys()
    assert len({k.name for k in keys}) == len(keys)
    assert all(k.help for k in keys), [k.name for k in keys if not k.help]


def test_every_bench_declares_its_keys_with_defaults():
    for ep in entry_points(group=cli.BENCH_GROUP):
        keys = getattr(ep.load(), "TUNING_KEYS", None)
        assert keys, f"bench {ep.name} declares no TUNING_KEYS"
        assert len({k.name for k in keys}) == len(keys) and all(k.help for k in keys), ep.name


def test_calibrate_help_lists_the_stages():
    from ctxrelay.transports.heterofold.calibration.job import STAGES

    r = invoke("calibrate", "--help")
    assert r.exit_code == 0 and all(s in r.output for s in STAGES)


def _record(monkeypatch, target: str) -> list:
    calls: list = []

    def fake(*args, **kwargs):
        kwargs.pop("command", None)  # the command line recorded is each invocation's own
        calls.append((args, kwargs))
        return "recorded"

    monkeypatch.setattr(target, fake)
    return calls


def test_the_stage_sub_command_makes_the_same_call_as_set_stage(monkeypatch):
    calls = _record(monkeypatch, "ctxrelay.transports.heterofold.calibration.job.calibrate_job")
    pair = ("--sender", "qwen2.5-coder-1.5b", "--receiver", "gemma3-270m", "--out", "a.safetensors")
    old = invoke("calibrate", "--transport", "heterofold", *pair, "--set", "stage=refit", "--threads", "1")
    new = invoke("calibrate", "heterofold", "refit", *pair, "--threads", "1")
    both = invoke("calibrate", "heterofold", "refit", *pair, "--set", "stage=refit", "--threads", "1")
    assert (old.exit_code, new.exit_code, both.exit_code) == (0, 0, 0), old.output + new.output + both.output
    assert len(calls) == 3 and calls[0] == calls[1] == calls[2]
    assert calls[0][1]["options"] == {"stage": "refit"} and calls[0][1]["out"] == "a.safetensors"
    keep = invoke("calibrate", "heterofold", "keep", *pair, "--set", "fractions=0.2,0.3", "--threads", "1")
    assert keep.exit_code == 0 and calls[-1][1]["options"] == {"stage": "keep", "fractions": "0.2,0.3"}
    clash = invoke("calibrate", "heterofold", "keep", *pair, "--set", "stage=refit")
    assert clash.exit_code == 1 and len(calls) == 4


def test_bench_report_makes_the_same_call_as_set_phase_report(monkeypatch):
    module = cli.bench_module("heterofold-frontier")
    calls = _record(monkeypatch, f"{module.__name__}.report")
    old = invoke("bench", "heterofold-frontier", "--set", "phase=report", "--out", "frontier-x", "--threads", "1")
    new = invoke("bench", "report", "heterofold-frontier", "--out", "frontier-x")
    assert (old.exit_code, new.exit_code) == (0, 0), old.output + new.output
    assert calls == [(("frontier-x",), {}), (("frontier-x",), {})]
    default = invoke("bench", "report", "heterofold-frontier")
    assert default.exit_code == 0 and calls[-1] == (("heterofold-frontier",), {})
    assert invoke("bench", "report", "native").exit_code == 1  # a bench without a report step says so


def test_the_old_required_forms_still_parse(monkeypatch):
    """`ctxrelay calibrate --transport T --sender S --receiver R --set k=v` (shipped manifests record it)."""
    calls = _record(monkeypatch, "ctxrelay.transports.mapflow.calibration.job.calibrate_job")
    r = invoke("calibrate", "--transport", "mapflow", "--sender", "a", "--receiver", "b", "--set", "top_p=0.8",
               "--set", "force=true", "--threads", "1")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert calls == [(("a", "b"), {"out": None, "resume": True, "options": {"top_p": 0.8, "force": True}})]
    assert invoke("calibrate", "--transport", "mapflow", "--receiver", "b").exit_code == 1  # no sender
