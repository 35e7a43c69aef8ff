"""`ctxrelay bench peer-multiturn`: reading what vLLM's multi-turn client printed (a real capture of its run
against `ctxrelay serve`), and the recording proxy in front of a real server on a tiny model, whose
recorded turns give the reuse and prefill facts the rows count."""

import json
from pathlib import Path

import httpx
import pytest

from ctxrelay.relay import ModelPool
from ctxrelay.relay.graph import Profile
from ctxrelay.serve.app import Settings
from ctxrelay.serve.auth import load_keys
from ctxrelay_bench.harness import start
from ctxrelay_bench.peer_multiturn import turns, vllm_client
from ctxrelay_bench.peer_multiturn.proxy import RecordingProxy
from ctxrelay_bench.peer_multiturn.vllm_client import parse_summary, ttft_percentiles

SAMPLES = Path(__file__).parent / "samples"
AUTH = {"Authorization": "Bearer k-acme"}


def test_the_clients_printed_percentiles_are_those_of_its_own_stats():
    """Captured from a run of the pinned client (stdout, and its --stats-json-output of the same run)."""
    printed = parse_summary((SAMPLES / "vllm_multi_turn_stdout.txt").read_text())
    stats = vllm_client.read_stats(SAMPLES / "vllm_multi_turn_stats.json")
    assert printed["ttft_ms"]["count"] == len(stats)
    p50, p90 = ttft_percentiles(printed)
    want50, want90 = turns.percentiles_ms([r["ttft_ms"] for r in stats])
    assert p50 == pytest.approx(want50, abs=0.006) and p90 == pytest.approx(want90, abs=0.006)  # printed at 2 dp
    assert printed["input_num_turns"]["min"] == 1.0  # first turns are in the sample


def test_a_table_cut_to_fit_the_terminal_is_refused_not_misread():
    cut = "\n".join(["Statistics summary:", "-" * 10, "      count  mean  ...   90%   max",
                     "ttft_ms  7.0  1.0  ...  2.0  3.0"])  # fmt: skip
    with pytest.raises(ValueError):
        ttft_percentiles(parse_summary(cut))


def test_the_pin_locates_only_the_pinned_files(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_CACHE", str(tmp_path))
    with pytest.raises(Exception, match="at commit 00d395390c6d"):
        vllm_client.locate()
    folder = vllm_client.client_dir()
    folder.mkdir(parents=True)
    for name in vllm_client.FILES:
        (folder / name).write_text("# not vLLM's file\n")
    with pytest.raises(Exception, match="sha256 differs"):
        vllm_client.locate()


def test_metrics_text_gives_the_servers_reuse_hits():
    before = turns.metric_samples('# HELP x\nctxrelay_content_reuse_total{result="hit"} 2.0\n')
    after = turns.metric_samples('ctxrelay_content_reuse_total{result="hit"} 7.0\nctxrelay_content_reuse_total'
                                 '{result="miss"} 1.0\n')  # fmt: skip
    assert turns.reuse_hits(before, after) == 5 and turns.reuse_hits({}, after) == 7


@pytest.fixture(scope="module")
def served(tiny_by_family):
    pool = ModelPool([tiny_by_family["llama"]], artifact_dirs=[], profile=Profile())
    url, stop = start(pool, Settings(keys=load_keys(env="k-acme:acme")))
    yield url, tiny_by_family["llama"]
    stop()


def resend_conversation(url: str, model: str, asks: list[str]) -> None:
    """A stock client: the whole history each turn, streamed, no conversation id."""
    history: list[dict] = []
    for ask in asks:
        history.append({"role": "user", "content": ask})
        body = {"model": model, "messages": history, "max_tokens": 4, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
        history.append({"role": "assistant", "content": text})


@pytest.mark.parametrize("store_false", [False, True])
def test_the_proxy_records_each_turns_report_and_opts_out_on_request(served, store_false):
    url, llama = served
    before = turns.metric_samples(httpx.get(url + "/metrics").text)
    asks = [f"Tell me about {w} rivers, store_false={store_false}." for w in ("long", "short")] + ["And lakes?"]
    with RecordingProxy(url, 8399, store_false=store_false) as proxy:
        resend_conversation(proxy.url, llama.name, asks)
    after = turns.metric_samples(httpx.get(url + "/metrics").text)
    count = lambda s: len(llama.tokenizer(s, add_special_tokens=False).input_ids)
    facts = [turns.turn_facts(t, count) for t in proxy.turns]
    s = turns.summarize(facts, turns.reuse_hits(before, after), slack=8)
    assert (s["turns"], s["first_turns"], s["failed_turns"]) == (3, 1, 0)
    if store_false:  # stateless: every turn reads its whole history, nothing found
        assert s["turns_reusing_state"] == 0 and {f["reuse"] for f in facts} == {"none"}
        assert turns.transport_mix(facts) == "native" and not turns.reuse_bar(s)
    else:  # the history found by content: the stored state is the same model's own (self), exact
        assert s["turns_reusing_state"] == 2 and [f["reused_messages"] for f in facts] == [0, 2, 4]
        assert turns.transport_mix(facts) == "mixed" and s["transports"] == {"native": 1, "self": 2}
        assert all(f["overhead"] >= 0 for f in facts)  # a reusing turn prefills the new message and its template
        assert turns.reuse_bar(s) == (s["prefill_overhead_max"] <= 8)


def test_a_turn_sent_as_text_parts_counts_its_text_as_the_server_reads_it():
    """`vllm bench serve` sends each message as OpenAI's list of text parts: counted as their joined text."""
    parts = [{"type": "text", "text": "one two "}, {"type": "text", "text": "three"}]
    turn = {"messages": [{"role": "user", "content": parts}], "report": {"prefilled_tokens": 7}, "status": 200}
    as_text = {**turn, "messages": [{"role": "user", "content": "one two three"}]}
    count = lambda s: len(s.split())
    uncovered = [turns.turn_facts(t, count)["uncovered_tokens"] for t in (turn, as_text)]
    assert uncovered == [3, 3]
