"""`ctxrelay serve` itself, as a process: a tiny model saved as a local HF directory (with a chat
template, so the tokenizer's own template path runs), keys from the environment, the openai client,
and a graceful exit on SIGTERM."""

import signal

import httpx
import openai
from processes import launch, save_chat_model, serve_env


def test_ctxrelay_serve_process(tiny_by_family, tmp_path):
    model_dir = save_chat_model(tiny_by_family["llama"], tmp_path / "tiny-llama-chat")
    env = serve_env(tmp_path / "cache", "sk-test:acme")
    server = launch(["--models", str(model_dir)], env, tmp_path)
    try:
        url = server.wait_up(120).url
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
        code = server.stop(signal.SIGTERM)
    # uvicorn finishes in-flight requests, then re-raises the signal it caught
    out = server.log()
    assert code in (0, -signal.SIGTERM) and "Finished server process" in out, out
