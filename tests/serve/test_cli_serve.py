"""`ctxrelay serve` itself, as a process: a tiny model saved as a local HF directory (with a chat
template, so the tokenizer's own template path runs), keys from the environment, the openai client,
and a graceful exit on SIGTERM."""

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from server_fixture import TEMPLATE, free_port

SRC = Path(__file__).resolve().parents[2] / "src"


def test_ctxrelay_serve_process(tiny_by_family, tmp_path):
    m = tiny_by_family["llama"]
    model_dir = tmp_path / "tiny-llama-chat"
    tok = copy.deepcopy(m.tokenizer)
    tok.chat_template = TEMPLATE
    m.hf.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    port = free_port()
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "CTXRELAY_API_KEYS": "sk-test:acme", "CTXRELAY_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": path, "CTXRELAY_THREADS": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "ctxrelay.cli", "serve", "--models", str(model_dir), "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "ctxrelay serve did not come up"
            time.sleep(0.2)
        c = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
        msgs = [{"role": "user", "content": "Hello?"}]
        full = c.chat.completions.create(model=model_dir.name, messages=msgs, max_tokens=6,
                                         extra_body={"conversation": "new"})  # fmt: skip
        conv = full.ctxrelay["conversation"]
        msgs += [{"role": "assistant", "content": full.choices[0].message.content}, {"role": "user", "content": "?"}]
        chunks = list(c.chat.completions.create(model=model_dir.name, messages=msgs, max_tokens=6, stream=True,
                                                extra_body={"conversation": conv}))  # fmt: skip
        assert chunks[-1].ctxrelay["transport"] == "self" and chunks[-1].ctxrelay["turn"] == 2
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    # uvicorn finishes in-flight requests, then re-raises the signal it caught
    assert proc.returncode in (0, -signal.SIGTERM) and "Finished server process" in out, out
