"""A vLLM engine (its CPU build) as a process ctxrelay starts, talks to over loopback HTTP, and stops.

vLLM lives in its own virtual environment (`make vllm`: it pins transformers below what ctxrelay's venv
resolves), so ctxrelay never imports it here: each served model gets one OpenAI-compatible vLLM server
(`python -m vllm.entrypoints.openai.api_server`; the `vllm serve` command fails on the CPU build's
distribution name) with ctxrelay's KV connector loaded by module path, prefix caching on, bound to
127.0.0.1. Requests go to its /v1/completions as token ids (ctxrelay renders chat templates and owns the
relay), with `kv_transfer_params` naming the K/V file the connector loads and a `cache_salt` that keeps
tenants (and approximate K/V) apart in the engine's prefix cache.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from ctxrelay.engines.vllm_params import cpu_engine_env, transfer_config
from ctxrelay.errors import UsageError
from ctxrelay.results import bf16_native

ENV_PYTHON = "CTXRELAY_VLLM_PYTHON"  # the vLLM venv's python, where it is not ./.venv-vllm
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # an engine's K/V dtype
START_TIMEOUT_S = 600.0  # a compiled CPU engine takes ~80 s on 2 cores; a loaded machine more


def vllm_python() -> Path | None:
    """The python of the venv holding vLLM's CPU build and ctxrelay (`make vllm`), or None."""
    found = os.environ.get(ENV_PYTHON)
    candidates = [Path(found)] if found else [Path.cwd() / ".venv-vllm/bin/python", _repo() / ".venv-vllm/bin/python"]
    return next((p for p in candidates if p.is_file() and os.access(p, os.X_OK)), None)


def _repo() -> Path:
    return Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STATE_READERS = ("auto", "engine", "runner")


@dataclass
class EngineConfig:
    """How one model's engine runs. `dtype` "auto" picks bf16 where the CPU has AVX512-bf16 or AMX and fp32
    elsewhere (vLLM's bf16 path on AVX2 measured 4-5x slower than its fp32 one: vllm-native.json)."""

    dtype: str = "auto"
    compiled: bool = False  # vLLM's default mode (torch.compile, ~80 s to start); eager starts in 25-40 s
    kv_space_gib: float = 2.0
    max_model_len: int = 16384  # or the model's own window where shorter
    max_num_seqs: int = 64
    seed: int = 0
    profile_lengths: tuple[int, ...] = (2048, 4096)  # where the gate's engine costs are measured (then interpolated)
    extra_args: list[str] = field(default_factory=list)
    # the engine's processes run at this niceness: on a CPU host they share the cores with the router, whose work
    # is short and on the request path (streaming tokens, /healthz, the relay); the engine's is throughput. Under
    # 101 streams /healthz took up to 0.17 s with both at the same priority
    nice: int = 5
    # who reads the state a turn leaves: the engine (capturing its K/V), ctxrelay's runner, or "auto": the one
    # whose measured native prefill is faster (on an AVX2 CPU vLLM fp32 can be the slower of the two)
    state_reader: str = "auto"

    @staticmethod
    def from_options(
        engine: str, mode: str, dtype: str, kv_space_gib: float, profile_lengths: str, state_reader: str = "auto"
    ) -> EngineConfig:
        """The config `ctxrelay serve --engine ... --engine-mode ...` asks for, checked."""
        if engine not in ("native", "vllm") or mode not in ("eager", "compiled"):
            raise UsageError(f"--engine is native or vllm, --engine-mode eager or compiled (got {engine}, {mode})")
        if state_reader not in STATE_READERS:
            raise UsageError(f"--engine-state is one of {', '.join(STATE_READERS)}, not {state_reader!r}")
        try:
            lengths = tuple(int(n) for n in profile_lengths.split(",") if n)
        except ValueError:
            bad = f"--engine-profile-lengths is a comma list of token counts, not {profile_lengths!r}"
            raise UsageError(bad) from None
        return EngineConfig(dtype, mode == "compiled", kv_space_gib, profile_lengths=lengths, state_reader=state_reader)

    def resolved_dtype(self, isa: str, bf16: bool | None = None) -> str:
        """auto: bf16 where the CPU multiplies it natively (AMX, AVX512-bf16), fp32 elsewhere (vLLM's bf16 path on
        AVX2 measured 4-5x slower than its fp32 one; AVX512 without its bf16 extension emulates it too)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if bf16_native(isa, bf16) else "float32"

    @property
    def mode(self) -> str:
        return "compiled" if self.compiled else "eager"


class VllmServer:
    """One model's vLLM engine process. `start()` waits until it answers /health; `stop()` ends the whole
    process group (the engine is three processes)."""

    def __init__(
        self, name: str, model_dir: Path, weights_hash: str, config: EngineConfig, isa: str, log_dir: Path,
        window: int | None = None,
    ):  # fmt: skip
        self.name, self.model_dir, self.weights_hash, self.config = name, model_dir, weights_hash, config
        self.max_model_len = min(config.max_model_len, window or config.max_model_len)
        self.dtype = config.resolved_dtype(isa)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"vllm-{name}-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def command(self, python: Path) -> list[str]:
        c = self.config
        cmd = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
            "--served-model-name", self.name, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", self.dtype, "--enable-prefix-caching", "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(c.max_num_seqs), "--seed", str(c.seed), "--disable-uvicorn-access-log",
            "--enable-prompt-tokens-details",  # usage says how many prompt tokens the prefix cache served
            "--kv-transfer-config", json.dumps(transfer_config(self.weights_hash)),
        ]  # fmt: skip
        if not c.compiled:
            cmd.append("--enforce-eager")
        nice = ["nice", "-n", str(c.nice)] if c.nice else []
        return nice + cmd + list(c.extra_args)

    def start(self, python: Path | None = None, timeout_s: float = START_TIMEOUT_S) -> None:
        python = python or vllm_python()
        if python is None:
            raise UsageError(
                f"--engine vllm needs vLLM's CPU build in its own venv: run `make vllm` (or set {ENV_PYTHON})"
            )
        env = cpu_engine_env(self.config.kv_space_gib, dict(os.environ))
        env.pop("PYTHONPATH", None)  # the engine's venv has its own ctxrelay (editable) and transformers
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.command(python), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UsageError(f"vLLM engine for {self.name} exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise UsageError(f"vLLM engine for {self.name} did not answer within {timeout_s:.0f} s; see {self.log_path}")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
