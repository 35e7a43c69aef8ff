"""`ctxrelay serve --engine vllm` as a user runs it: two zoo models, one vLLM engine each (started by the
server), and the official openai client. A conversation reads a >= 4096-token document on smollm2-135m and
moves to gemma3-270m, which MUST relay (heterofold, through the connector) and answer as vLLM's own prefill
of the same prompt does. Skipped with the reason where vLLM's CPU build is not installed (`make vllm`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from vllm_env import VLLM_PYTHON, record_checks, vllm_missing

from ctxrelay import zoo
from ctxrelay.data.datasets import essay_haystack
from ctxrelay.data.needle import make_needle_case, score_answer

pytestmark = pytest.mark.real
MODELS = ("smollm2-135m", "gemma3-270m")
KEY, OTHER = "k-acme", "k-globex"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    missing = vllm_missing()
    if missing:
        pytest.skip(missing)
    from ctxrelay_bench.harness import free_port

    log_path = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    port = free_port()
    env = {**os.environ, "CTXRELAY_API_KEYS": f"{KEY}:acme,{OTHER}:globex", "CTXRELAY_VLLM_PYTHON": str(VLLM_PYTHON)}
    cmd = [
        sys.executable, "-m", "ctxrelay.cli", "serve", "--engine", "vllm", "--models", ",".join(MODELS),
        "--host", "127.0.0.1", "--port", str(port), "--max-tokens", "64", "--engine-state", "engine",
    ]  # fmt: skip
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    # two engines start (25-40 s each, eager) and, on a machine that has not measured them, the gate's costs
    deadline = time.monotonic() + 1800
    try:
        while True:
            assert proc.poll() is None, f"ctxrelay serve exited:\n{log_path.read_text()[-6000:]}"
            try:
                if httpx.get(url + "/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"ctxrelay serve did not come up:\n{log_path.read_text()[-6000:]}"
            time.sleep(2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        leftovers = subprocess.run(["pgrep", "-f", "vllm.entrypoints.openai.api_server"], capture_output=True)
        assert leftovers.returncode != 0, "the server left vLLM engines running after it stopped"


def _turns(client, doc: str, question: str, transport: str) -> tuple[dict, str]:
    first = [{"role": "user", "content": f"Here is a document.\n\n{doc}"}]
    r1 = client.chat.completions.create(
        model=MODELS[0], messages=first, max_tokens=4, extra_body={"conversation": "new"}
    )
    report1 = r1.model_extra["ctxrelay"]
    assert report1["engine"]["name"] == "vllm" and report1["context_tokens"] >= 4096, report1
    history = [*first, {"role": "assistant", "content": r1.choices[0].message.content}]
    r2 = client.chat.completions.create(
        model=MODELS[1], messages=[*history, {"role": "user", "content": question}], max_tokens=24,
        extra_body={"conversation": report1["conversation"], "transport": transport},
    )  # fmt: skip
    return r2.model_extra["ctxrelay"], r2.choices[0].message.content


def test_a_conversation_moves_from_smollm2_to_gemma3_and_relays_inside_vllm(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key=KEY, timeout=600, max_retries=0)
    case = make_needle_case(essay_haystack(zoo.load(MODELS[0]).tokenizer, 4200, "heldout", 11), 0.5, 11)
    asked = case.question.strip().split("\n")[0].removeprefix("Question: ")
    question = f"Using only the document, answer in a few words: {asked}"
    relayed, relayed_text = _turns(client, case.context, question, "auto")
    native, native_text = _turns(client, case.context, question, "native")
    right = {k: score_answer(t, case.answer)["exact"] for k, t in (("relay", relayed_text), ("native", native_text))}
    checks = {
        # the gate relayed turn 2 from smollm2's state; the engine prefilled only the new turn
        "relayed": relayed["transport"] == "heterofold" and relayed["relayed_from"] == MODELS[0]
        and relayed["prefilled_tokens"] < 200,
        "native_is_native": native["transport"] == "native" and native["context_tokens"] == relayed["context_tokens"],
        # the relayed (approximate) blocks sat under a salt of their own: the same prompt sent natively after
        # it found none of them in the engine's prefix cache
        "no_prefix_crossing": native["engine_cached_tokens"] == 0,
        "answers_as_native": right["relay"] == right["native"],
        # smollm2's engine read turn 1's transcript and left its K/V: no runner prefill of the sender's state
        "state_captured_by_engine": relayed["state_made"] == "prefilled by vllm",
    }  # fmt: skip
    detail = (
        f"{relayed['context_tokens']} context tokens; relayed ({relayed['reason']}) in {relayed['ttft_s']:.2f} s: "
        f"{relayed_text!r}; native in {native['ttft_s']:.2f} s: {native_text!r}; gold {case.answer!r}; "
        f"native request's cached tokens {native['engine_cached_tokens']}; {checks}"
    )
    row = {
        "check": "serve_two_models_relayed", "passed": all(checks.values()), "detail": detail,
        "transport": relayed["transport"], "engine": "vllm", "value": native["ttft_s"] / relayed["ttft_s"],
    }  # fmt: skip
    record_checks("vllm-checks", [row], "pytest -m real tests/engines/test_vllm_serve.py")
    print(detail)
    assert checks["relayed"], f"the gate declined or relayed otherwise: {relayed}"
    assert checks["native_is_native"], native
    assert checks["no_prefix_crossing"], native
    assert checks["state_captured_by_engine"], relayed
    assert checks["answers_as_native"], (right, relayed_text, native_text, relayed["reason"])


def test_tenants_never_share_the_engine_prefix_cache(server):
    from openai import OpenAI

    doc = essay_haystack(zoo.load(MODELS[1]).tokenizer, 600, "heldout", 12)
    messages = [{"role": "user", "content": f"{doc}\n\nWhat is this text about?"}]

    def cached(key: str) -> int:
        client = OpenAI(base_url=server + "/v1", api_key=key, timeout=600, max_retries=0)
        r = client.chat.completions.create(model=MODELS[1], messages=messages, max_tokens=2)
        return r.model_extra["ctxrelay"]["engine_cached_tokens"]

    first, again, other = cached(KEY), cached(KEY), cached(OTHER)
    assert first == 0 and again >= 512, (first, again)  # the same tenant's prompt: whole blocks from the cache
    assert other == 0  # another tenant's identical prompt: none of the first tenant's blocks
