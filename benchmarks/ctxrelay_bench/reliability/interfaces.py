"""Reliability at the doors: bad input through the Python API, the CLI and HTTP; API keys; concurrent
turns of one conversation and a burst past the queue bound; a model checkpoint swapped under its
artifact. Each function returns one category's `Count` (store_checks.Count).

A correct answer to bad input is a named error (Python: a CtxrelayError; CLI: exit status 1 or 2
and one `error:` line, no traceback; HTTP: the expected 4xx with a message). Over HTTP a request
failed when it got a 5xx, a dropped connection or a wrong status.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ctxrelay.errors import CtxrelayError
from ctxrelay.models.spec import LoadedModel, hash_state_dict
from ctxrelay.relay.api import ModelPool
from ctxrelay.serve.app import Settings
from ctxrelay.serve.auth import load_keys
from ctxrelay_bench.harness import relay_pool, start
from ctxrelay_bench.reliability.store_checks import BASE_TEXT, SUFFIX, Count

LONG = "word " * 5000  # past a tiny model's 4096-position window


def _refused(c: Count, what: str, call: Callable[[], object]) -> None:
    """One bad-input case: `call` must raise a CtxrelayError."""
    c.cases += 1
    c.requests += 1
    try:
        call()
    except CtxrelayError:
        return
    except Exception as e:  # noqa: BLE001 - what this counts
        c.unhandled += 1
        c.fail(f"{what}: {type(e).__name__}: {e}")
        return
    c.fail(f"{what}: accepted")


# ---- Python API --------------------------------------------------------------------------------


def python_api(pool: ModelPool, model: str) -> Count:
    c = Count()
    ok = pool.prefill(model, BASE_TEXT, "acme", store=False)
    cases: dict[str, Callable[[], object]] = {
        "prefill empty text": lambda: pool.prefill(model, "", "acme"),
        "prefill invalid UTF-8": lambda: pool.prefill(model, "bad \udcff bytes", "acme"),
        "prefill not text": lambda: pool.prefill(model, b"bytes", "acme"),
        "prefill past the context window": lambda: pool.prefill(model, LONG, "acme"),
        "prefill unknown model": lambda: pool.prefill("no-such-model", BASE_TEXT, "acme"),
        "continue unknown receiver": lambda: pool.continue_from(ok, "no-such-model", SUFFIX),
        "continue negative max tokens": lambda: pool.continue_from(ok, model, SUFFIX, max_new_tokens=-1),
        "continue zero max tokens": lambda: pool.continue_from(ok, model, SUFFIX, max_new_tokens=0),
        "continue huge max tokens": lambda: pool.continue_from(ok, model, SUFFIX, max_new_tokens=10**9),
        "continue unknown transport": lambda: pool.continue_from(ok, model, SUFFIX, transport="teleport"),
        "continue invalid UTF-8 suffix": lambda: pool.continue_from(ok, model, "\ud800"),
        "continue negative temperature": lambda: pool.continue_from(ok, model, SUFFIX, temperature=-1.0),
        "continue NaN temperature": lambda: pool.continue_from(ok, model, SUFFIX, temperature=float("nan")),
        "continue empty text": lambda: pool.continue_from("", model, SUFFIX, tenant="acme", sender=model),
        "continue text past the window": lambda: pool.continue_from(LONG, model, SUFFIX, tenant="a", sender=model),
        "native past the window": lambda: pool.native(model, LONG, SUFFIX),
        "another tenant's state": lambda: pool.continue_from(ok, model, SUFFIX, tenant="globex"),
    }
    for what, call in cases.items():
        _refused(c, what, call)
    return c


# ---- CLI ---------------------------------------------------------------------------------------


def cli_cases(root: Path) -> dict[str, list[str]]:
    """Bad options to the commands that take text, models and numbers; none may load a model first."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (root / "empty.txt").write_text("  \n")
    q = ["--question", "what?"]
    return {
        "unknown benchmark": ["bench", "no-such-bench"],
        "unknown bench option": ["bench", "reliability", "--set", "no_such_option=1"],
        "missing context file": ["demo", "--context", str(root / "missing.txt"), *q],
        "context not UTF-8": ["demo", "--context", str(root / "latin1.txt"), *q],
        "empty context": ["demo", "--context", str(root / "empty.txt"), *q],
        "context without a question": ["demo", "--context", str(root / "empty.txt")],
        "negative max tokens": ["demo", "--max-new-tokens", "-5"],
        "zero tokens": ["demo", "--tokens", "0"],
        "unknown sender": ["demo", "--sender", "no-such-model"],
        "unknown receiver": ["demo", "--receivers", "no-such-model"],
        "unknown transport": ["calibrate", "--transport", "teleport", "--sender", "a", "--receiver", "b"],
        "unknown store": ["serve", "--store", "s3://bucket", "--models", "no-such-model"],
        "max tokens not a number": ["demo", "--max-new-tokens", "many"],
    }


def cli(root: Path, only: int | None = None) -> Count:
    """Each case run as the `ctxrelay` command (a process of its own): exit 1 with one `error:` line,
    or click's usage error (exit 2); never a traceback. `only`: the first N cases."""
    c = Count()
    env = {**os.environ, "CTXRELAY_THREADS": "1", "CTXRELAY_DEBUG": "", "COLUMNS": "200"}
    for what, args in list(cli_cases(root).items())[:only]:
        c.cases += 1
        c.requests += 1
        res = subprocess.run([sys.executable, "-m", "ctxrelay.cli", *args], capture_output=True, text=True, env=env,
                             timeout=300)  # fmt: skip
        out = (res.stdout + res.stderr).strip()
        lines = [ln for ln in out.splitlines() if ln.strip()]
        if "Traceback" in out:
            c.unhandled += 1
            c.fail(f"{what}: a traceback: {out[-300:]!r}")
        elif res.returncode not in (1, 2) or (res.returncode == 1 and (len(lines) != 1 or "error:" not in out)):
            c.fail(f"{what}: exit {res.returncode}, output {out[-300:]!r}")
    return c


# ---- HTTP --------------------------------------------------------------------------------------

KEYS = "k-acme:acme,k-globex:globex"


def call(url: str, method: str, path: str, body: bytes | dict | None = None, key: str | None = "k-acme"):
    """(status, JSON body or None); status 0 when the connection dropped."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = key if key.startswith("Basic") else f"Bearer {key}"
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    except (OSError, http.client.HTTPException):
        return 0, None
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, None


@contextmanager
def server(sender: LoadedModel, receiver: LoadedModel, root: Path, **settings) -> Iterator[tuple[str, ModelPool]]:
    pool = relay_pool(sender, receiver, root / "artifacts")
    url, stop = start(pool, Settings(keys=load_keys(env=KEYS), **settings))
    try:
        yield url, pool
    finally:
        stop()


def http_doors(url: str, sender: str, receiver: str) -> Count:
    c = Count()
    chat = lambda **kw: {"model": sender, "messages": [{"role": "user", "content": "Hi"}], **kw}
    cont = lambda **kw: {"sender": sender, "receiver": receiver, "text": BASE_TEXT, **kw}
    surrogate = b'{"sender": "%s", "text": "bad \\ud800 text"}' % sender.encode()
    cases = [
        ("missing key", "GET", "/v1/models", None, None, 401),
        ("wrong key", "GET", "/v1/models", None, "k-nobody", 401),
        ("not a bearer key", "POST", "/prefill", {"sender": sender, "text": "x"}, "Basic abc", 401),
        ("prefill empty text", "POST", "/prefill", {"sender": sender, "text": ""}, "k-acme", 400),
        ("prefill unknown model", "POST", "/prefill", {"sender": "no-such", "text": "x"}, "k-acme", 404),
        ("prefill invalid UTF-8 bytes", "POST", "/prefill", b'{"sender": "x", "text": "\xff\xfe"}', "k-acme", 400),
        ("prefill lone surrogate", "POST", "/prefill", surrogate, "k-acme", 400),
        ("prefill past the window", "POST", "/prefill", {"sender": sender, "text": LONG}, "k-acme", 400),
        ("prefill not JSON", "POST", "/prefill", b"{not json", "k-acme", 400),
        ("continue negative max tokens", "POST", "/continue", cont(max_new_tokens=-1), "k-acme", 400),
        ("continue huge max tokens", "POST", "/continue", cont(max_new_tokens=10**9), "k-acme", 400),
        ("continue unknown transport", "POST", "/continue", cont(transport="teleport"), "k-acme", 400),
        ("continue empty text", "POST", "/continue", cont(text=""), "k-acme", 400),
        ("chat negative max tokens", "POST", "/v1/chat/completions", chat(max_tokens=-5), "k-acme", 400),
        ("chat huge max tokens", "POST", "/v1/chat/completions", chat(max_tokens=10**9), "k-acme", 400),
        ("chat unknown model", "POST", "/v1/chat/completions", chat(model="no-such"), "k-acme", 404),
        ("chat unknown transport", "POST", "/v1/chat/completions", chat(transport="teleport"), "k-acme", 400),
        ("chat no messages", "POST", "/v1/chat/completions", chat(messages=[]), "k-acme", 400),
        ("chat lone surrogate", "POST", "/v1/chat/completions",
         b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % sender.encode(), "k-acme", 400),
        ("chat past the window", "POST", "/v1/chat/completions",
         chat(messages=[{"role": "user", "content": LONG}]), "k-acme", 400),
        ("completion empty prompt", "POST", "/v1/completions", {"model": sender, "prompt": ""}, "k-acme", 400),
        ("another tenant's conversation", "POST", "/v1/chat/completions", chat(conversation="conv-x"), "k-acme", 404),
    ]  # fmt: skip
    for what, method, path, body, key, want in cases:
        c.cases += 1
        c.requests += 1
        status, got = call(url, method, path, body, key)
        message = ((got or {}).get("error") or {}).get("message") if isinstance(got, dict) else None
        if status != want or not message:
            c.fail(f"{what}: got {status} {str(got)[:200]}, expected {want} with a message")
    # a tenant's state is never another's: globex continuing acme's text gets native prefill
    c.cases += 1
    c.requests += 2
    call(url, "POST", "/prefill", {"sender": sender, "text": BASE_TEXT}, "k-acme")
    status, got = call(url, "POST", "/continue", cont(receiver=sender, max_new_tokens=2), "k-globex")
    if status != 200 or got["transport"] != "native" or "no stored state" not in got["reason"]:
        c.fail(f"globex read acme's state: {status} {str(got)[:200]}")
    return c


def concurrency(url: str, model: str, threads: int = 8, burst: int = 12) -> Count:
    """Concurrent turns of one conversation (one runs, the others 409) and a burst of stateless requests
    past the queue bound (each 200 or 429); nothing 5xx, nothing dropped, the conversation intact."""
    c = Count()
    status, first = call(url, "POST", "/v1/chat/completions",
                         {"model": model, "messages": [{"role": "user", "content": "Hello"}], "conversation": "new",
                          "max_tokens": 2})  # fmt: skip
    conv = first["ctxrelay"]["conversation"]
    statuses: list[int] = []

    def turn(i: int) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": f"turn {i}"}], "conversation": conv,
                "max_tokens": 4}  # fmt: skip
        statuses.append(call(url, "POST", "/v1/chat/completions", body)[0])

    def stateless(i: int) -> None:
        statuses.append(call(url, "POST", "/v1/completions", {"model": model, "prompt": f"p {i}", "max_tokens": 4})[0])

    for fn, n, allowed in ((turn, threads, (200, 409, 429)), (stateless, burst, (200, 429))):
        statuses.clear()
        ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        c.cases += 1
        c.requests += n
        for s in statuses:
            if s not in allowed:
                c.fail(f"{fn.__name__}: status {s}")
        c.details[fn.__name__] = {str(s): statuses.count(s) for s in sorted(set(statuses))}
    c.requests += 1
    status, last = call(url, "POST", "/v1/chat/completions",
                        {"model": model, "messages": [{"role": "user", "content": "last"}], "conversation": conv,
                         "max_tokens": 2})  # fmt: skip
    served_turns = c.details["turn"].get("200", 0)
    if status != 200 or last["ctxrelay"]["turn"] != served_turns + 2:  # the first, the concurrent ones served, this
        c.fail(f"the conversation lost a turn: {status} {str(last)[:200]}")
    return c


# ---- a checkpoint swapped under its artifact ---------------------------------------------------


@contextmanager
def _cache(root: Path) -> Iterator[None]:
    old = os.environ.get("CTXRELAY_CACHE")
    os.environ["CTXRELAY_CACHE"] = str(root)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CTXRELAY_CACHE")
        else:
            os.environ["CTXRELAY_CACHE"] = old


def model_swap(original: LoadedModel, other: LoadedModel, receiver: LoadedModel, root: Path) -> Count:
    """A zoo cache entry whose weights file is replaced by another checkpoint (the manifest keeps the old
    hash): the loader hashes what it loaded, the artifact is refused by name, requests are native."""
    from ctxrelay import zoo

    c = Count()
    name = next(iter(zoo.ZOO))  # a zoo name: the path that trusted the manifest's hash
    with _cache(root / "cache"):
        d = zoo.model_dir(name)
        original.hf.save_pretrained(d)
        original.tokenizer.save_pretrained(d)
        manifest = {"name": name, "weights_hash": hash_state_dict(original.hf), "conversion_version": 1}
        (d / "ctxrelay.json").write_text(json.dumps(manifest))
        loaded = zoo.load(name, pull_missing=False)
        pool = relay_pool(loaded, receiver, root / "artifacts")
        c.cases += 1
        if not pool.graph.edges_between(loaded.spec.weights_hash, receiver.spec.weights_hash):
            c.fail("before the swap the artifact's edge is missing")
        swap_dir = root / "other"
        other.hf.save_pretrained(swap_dir)
        for f in swap_dir.glob("*.safetensors"):
            shutil.copyfile(f, d / f.name)  # same name, same manifest: only the bytes differ
        c.faults_injected += 1
        swapped = zoo.load(name, pull_missing=False)
        c.cases += 1
        if swapped.spec.weights_hash != hash_state_dict(other.hf) or "not the checkpoint" not in swapped.extra.get(
            "weights_note", ""
        ):
            c.fail("the swapped checkpoint kept the manifest's hash")
        pool2 = ModelPool([swapped, receiver], artifact_dirs=[root / "artifacts"], profile=pool.profile,
                          quality_threshold=0.0)  # fmt: skip
        c.requests += 1
        state = pool2.prefill(swapped.name, BASE_TEXT, "acme")
        res = pool2.continue_from(state, receiver.name, SUFFIX, max_new_tokens=4)
        ref = pool2.native(receiver.name, BASE_TEXT, SUFFIX, max_new_tokens=4)
        if res.transport != "native" or "different checkpoint" not in res.reason or res.tokens != ref.tokens:
            c.fail(f"swapped sender served by {res.transport}: {res.reason}")
        c.requests += 1
        old_state = pool.prefill(loaded.name, BASE_TEXT, "acme", store=False)  # made by the original weights
        res = pool2.continue_from(old_state, swapped.name, SUFFIX, max_new_tokens=4)
        ref = pool2.native(swapped.name, BASE_TEXT, SUFFIX, max_new_tokens=4)
        if res.transport != "native" or res.tokens != ref.tokens:
            c.fail(f"a state of the original weights was used by the swapped model: {res.transport}")
        c.details = {"kinds": ["checkpoint swapped under its artifact"], "note": swapped.extra.get("weights_note", ""),
                     "reason": res.reason,
                     "skipped": pool2.graph.skipped}  # fmt: skip
    return c
