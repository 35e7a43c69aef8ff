"""vLLM's multi-turn serving client (`benchmarks/multi_turn/` of vLLM's repository), pinned and run unmodified.

It is vLLM's code, not ours: nothing of it is in this repository. The bench reads it from
`<cache>/peer/vllm-multi-turn-<commit[:12]>/` and checks each file's sha256 against the pin below; where a
file is missing or differs it stops and says where to get it. The client imports `vllm` (for
`vllm.benchmarks.lib.utils`) and pandas, so it runs with the python of vLLM's venv (`make vllm`, or
$CTXRELAY_VLLM_PYTHON). Its own flags drive it: synthetic conversations from a generation config
(`write_config`, its `generate_conversations` format), `--stats-json-output` for the per-request stats.
`parse_summary` reads the statistics table it prints (pandas' `describe()`, possibly wrapped in blocks).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from ctxrelay import paths
from ctxrelay.errors import UsageError

REPOSITORY = "vllm-project/vllm"
FOLDER = "benchmarks/multi_turn"
COMMIT = "00d395390c6da9baf1080664e8120d9e39956c5e"  # the script's commit; its siblings' are below
# file -> (the commit of the stored version read, sha256 of its bytes): the script imports the other two
FILES = {
    "benchmark_serving_multi_turn.py": (COMMIT, "c02f56343c983a72d8fe95139b9e441ef5207dd8a4129ccf46a041c4b9cf8086"),
    "bench_dataset.py": (
        "0fdcab7e1f5ca53acbf5a1a6d88268a73ee4429a",
        "ba1d1714e01728cfa8b80f02d49b1304da298c620ab58c9bca5924aaa847b19a",
    ),
    "bench_utils.py": (
        "d0ac57910c16de107f5758d0e530b638d8b0f91b",
        "b968e44ef6260fd1cea8410b3bf4cab751d9d4ad14bdc43f6268d113ad81a548",
    ),
}
SCRIPT = "benchmark_serving_multi_turn.py"
NAME = f"vllm {FOLDER}@{COMMIT[:12]}"


def client_dir() -> Path:
    return paths.cache_dir() / "peer" / f"vllm-multi-turn-{COMMIT[:12]}"


def how_to_get() -> str:
    lines = [f"  {FOLDER}/{name} at commit {commit}  (sha256 {digest})" for name, (commit, digest) in FILES.items()]
    return (
        f"put vLLM's multi-turn client, unmodified, in {client_dir()}/ (these files of {REPOSITORY}, each as "
        "it is at its commit):\n" + "\n".join(lines)
    )


def locate() -> Path:
    """The folder holding the pinned client, every file checked against its sha256 (UsageError otherwise)."""
    folder = client_dir()
    for name, (_, digest) in FILES.items():
        f = folder / name
        if not f.is_file():
            raise UsageError(f"vLLM's multi-turn client is missing {f}; {how_to_get()}")
        if hashlib.sha256(f.read_bytes()).hexdigest() != digest:
            raise UsageError(f"{f} is not the pinned file (sha256 differs); {how_to_get()}")
    return folder


def write_config(
    path: Path, text_file: Path, conversations: int, min_messages: int, max_messages: int, prefix_tokens: int,
    input_tokens: tuple[int, int], output_tokens: int,
) -> dict:  # fmt: skip
    """The client's synthetic-conversation config (its `generate_conversations` filetype): `conversations`
    conversations of min..max messages (user and assistant; the client rounds up to even), a first turn
    that opens with `prefix_tokens` tokens of `text_file`, user turns of input_tokens (min, max) tokens and
    answers of `output_tokens` tokens (its max_tokens)."""
    conf = {
        "filetype": "generate_conversations",
        "num_conversations": conversations,
        "text_files": [str(text_file)],
        "print_stats": False,
        "prompt_input": {
            "num_turns": {"distribution": "uniform", "min": min_messages, "max": max_messages},
            "prefix_num_tokens": {"distribution": "constant", "value": prefix_tokens},
            "num_tokens": {"distribution": "uniform", "min": input_tokens[0], "max": input_tokens[1]},
        },
        "prompt_output": {"num_tokens": {"distribution": "constant", "value": output_tokens}},
    }
    path.write_text(json.dumps(conf, indent=1))
    return conf


def command(
    python: Path, folder: Path, tokenizer_dir: Path, served_name: str, url: str, api_key: str, config: Path,
    stats_out: Path, seed: int, timeout_s: int,
) -> list[str]:  # fmt: skip
    """The client's command line: one client, one conversation at a time, streamed, its own defaults else."""
    return [
        str(python), str(folder / SCRIPT), "--input-file", str(config), "--model", str(tokenizer_dir),
        "--served-model-name", served_name, "--url", url, "--api-key", api_key, "--num-clients", "1",
        "--seed", str(seed), "--request-timeout-sec", str(timeout_s), "--stats-json-output", str(stats_out),
    ]  # fmt: skip


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_COLUMN = re.compile(r"^(count|mean|std|min|max|\d+(\.\d+)?%)$")


def parse_summary(text: str) -> dict[str, dict[str, float]]:
    """The last statistics table the client printed ("Statistics summary"), as {row: {column: value}}.

    pandas prints `describe().transpose()` with one row per metric (ttft_ms, tpot_ms, ...) and the columns
    count, mean, std, min, 25%, 50%, 75%, 90%, max; a table wider than the terminal comes in blocks, each
    with its own header line (and a trailing backslash on the header of all but the last)."""
    lines = _ANSI.sub("", text).splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Statistics summary")]
    if not starts:
        raise ValueError("the client printed no 'Statistics summary' table")
    table: dict[str, dict[str, float]] = {}
    columns: list[str] = []
    for line in lines[starts[-1] + 1 :]:
        words = line.replace("\\", " ").split()
        if not words or set(line.strip()) == {"-"} or "=" in line:
            if table and set(line.strip()) == {"-"}:
                break  # the separator after the table
            continue
        if all(_COLUMN.match(w) for w in words):
            columns = words
            continue
        if columns and len(words) == len(columns) + 1:
            table.setdefault(words[0], {}).update({c: float(v) for c, v in zip(columns, words[1:], strict=True)})
    if "ttft_ms" not in table:
        raise ValueError("the client's statistics table has no ttft_ms row")
    return table


def ttft_percentiles(summary: dict[str, dict[str, float]]) -> tuple[float, float]:
    """(p50, p90) TTFT in ms as the client printed them."""
    row = summary["ttft_ms"]
    if "50%" not in row or "90%" not in row:
        raise ValueError(f"the client's table lacks the 50% or 90% column (cut to fit the width?): {sorted(row)}")
    return row["50%"], row["90%"]


def read_stats(path: Path) -> list[dict]:
    """The client's per-request stats (`--stats-json-output`), in the order the requests started."""
    return sorted(json.loads(path.read_text()), key=lambda r: r["start_time_ms"])
