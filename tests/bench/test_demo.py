"""The demo on tiny models: rows for every receiver, a table that fits 100 columns, the user's own document."""

import json

import pytest
from rich.console import Console

from ctxrelay.demo import DemoConfig, print_table, run_demo
from ctxrelay.errors import UsageError
from ctxrelay.relay import ModelPool
from ctxrelay.relay.graph import Profile


@pytest.fixture
def pool(tiny_by_family, tmp_path):
    models = [tiny_by_family[f] for f in ("llama", "qwen2", "gemma3")]
    p = ModelPool(models, artifact_dirs=[tmp_path / "artifacts"], profile=Profile())
    p.profile_path = tmp_path / "profile.json"
    return p


def _cfg(pool, **kw) -> DemoConfig:
    s, *rs = pool.models
    return DemoConfig(sender=s, receivers=tuple(rs), tokens=160, max_new_tokens=4, profile_lengths=(64, 128), **kw)


def test_demo_rows_and_a_table_readable_in_100_columns(pool, tmp_path):
    console = Console(record=True, width=100)
    rows = run_demo(_cfg(pool), console, tmp_path / "demo.json", "pytest", pool=pool)
    assert [r["receiver"] for r in rows] == list(pool.models)[1:]
    assert all(r["transport"] == "native" and "no calibrated artifact" in r["reason"] for r in rows)
    assert all(r["answer"] == r["native_answer"] and "needle_acc" in r for r in rows)
    out = console.export_text()
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "1. " + rows[0]["receiver"] in out and "TTFT" in out  # the reasons are printed below the table
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert doc["quality_threshold"] == 0.85 and doc["rows"] == rows
    # no relay into these receivers (no artifacts): the gate reads no cost, so none is measured
    assert not (tmp_path / "profile.json").exists() and "nothing to measure" in out


def test_table_shows_the_native_answer_only_where_the_relay_differs():
    base = {"transport": "heterofold", "recompute_fraction": 0.3, "relay_ttft_s": 2.5, "native_ttft_s": 6.5,
            "speedup": 2.6, "reason": "r", "answer_token_f1": 1.0, "needle_acc": 1}  # fmt: skip
    rows = [
        dict(base, receiver="qwen2.5-coder-0.5b", answer="Copper-heron-42", native_answer="Copper-heron-42"),
        dict(
            base,
            receiver="smollm2-135m",
            answer="copper-heron-41 maybe",
            native_answer="It is copper-heron-42.",
            answer_token_f1=0.4,
            needle_acc=0,
        ),
    ]
    console = Console(record=True, width=100)
    print_table(console, rows, "copper-heron-42")
    out = console.export_text()
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "Copper-heron-42 " in out  # a passphrase is not folded in half
    assert out.count("native: ") == 1 and "native: It is" in out and "F1 0.40" in out and "wrong" in out
    flat = " ".join(out.split())
    assert "ctxrelay's own runner, a reference" in flat and "ctxrelay bench vllm-relay" in flat  # which native


def test_demo_on_the_users_own_document(pool, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The harbour master keeps the tide tables in the blue cabinet. " * 6)
    rows = run_demo(_cfg(pool, context_file=doc, question="Where are the tide tables?"), Console(width=100), None,
                    "pytest", pool=pool)  # fmt: skip
    assert len(rows) == 2 and all("needle_acc" not in r for r in rows)
    with pytest.raises(UsageError, match="--question"):
        run_demo(_cfg(pool, context_file=doc), Console(width=100), None, "pytest", pool=pool)
    empty = tmp_path / "empty.txt"
    empty.write_text("  ")
    with pytest.raises(UsageError, match="empty"):
        run_demo(_cfg(pool, context_file=empty, question="q?"), Console(width=100), None, "pytest", pool=pool)
    with pytest.raises(UsageError, match="cannot read"):
        run_demo(_cfg(pool, context_file=tmp_path / "missing.txt", question="q?"), Console(width=100), None,
                 "pytest", pool=pool)  # fmt: skip
