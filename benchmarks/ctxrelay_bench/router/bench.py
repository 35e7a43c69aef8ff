"""`ctxrelay bench router`: a threshold router between a large and a small model over multi-turn
conversations, native prefill (with a per-model prefix cache) against the relay (MapFlow's serving
experiment).

Measured, not invented:
  scores   per turn, each model's mean log-likelihood of the reference reply (one teacher-forced pass
           over each held-out ShareGPT conversation per model, cached), and the token counts per model
  costs    the cost models `ctxrelay profile` measured on this machine (native prefill per model, each
           relay edge's operating points), and each model's decode seconds per token, measured here
The router sends a turn to the large model when (score_large - score_small) + N(0, sigma) > tau;
tau sets p, the share of small-model turns that follow a large-model turn. Conversations arrive as a
Poisson process; a turn's next turn comes after the reply plus an exponential think time; each model
has its own server (FIFO). Per turn, the server's prefill work is
  native     what the model has not seen: its own K/V of its earlier turns is kept (a per-model prefix
             cache, as vLLM and SGLang keep), so it prefills only the turns since it last served
  full       the whole transcript again (no prefix cache), for reference
  relay      where the previous turn was served by the other model and an edge passes the gate at that
             length (the gate's default quality threshold and margin), the cheaper in expectation of that
             relay (+ the new turn prefilled over it) and the native prefix-cached prefill; else native.
             Where the gate's point carries a trusted per-request estimate, a turn's relay is refused with
             the share of calibration texts that estimate refused (drawn per turn, seeded): the relay is
             paid, then the prefix-cached native prefill, as the relay layer serves it
TTFT = queue wait + prefill; a server stays busy for the reply's decode (`reply_tokens`, capped).
"""

from __future__ import annotations

import heapq
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay import paths
from ctxrelay.data.datasets import Conversation, sharegpt_conversations
from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.spec import LoadedModel
from ctxrelay.models.tokens import tokenize_context
from ctxrelay.results import write_results
from ctxrelay.transports.base import keys_from
from ctxrelay_bench.load.bench import percentile
from ctxrelay_bench.plots import cdf_step, plot_path, save_figure
from ctxrelay_bench.runs import bench_options

OPTIONS = {"large": "qwen2.5-coder-1.5b", "small": "gemma3-270m", "conversations": 50, "max_turns": 4,
           "max_tokens": 2000, "turn_chars": 1500, "rate": 0.01, "think_s": 10.0, "sigma": 0.3,
           "reply_tokens": 32, "seeds": 5, "taus": 7, "slo_s": 5.0, "thresholds": "0.85,0.75",
           "rates": "0.0025,0.005,0.0075,0.01,0.015,0.02,0.03"}  # fmt: skip
# `ctxrelay bench router --keys`: each `--set` key, its default and meaning
TUNING_KEYS = keys_from(
    OPTIONS,
    {
        "large": "the large model",
        "small": "the small model",
        "conversations": "held-out ShareGPT conversations",
        "max_turns": "turns kept per conversation",
        "max_tokens": "longest transcript (tokens) a conversation may reach",
        "turn_chars": "characters each turn is cut to",
        "rate": "conversation arrivals per second",
        "think_s": "mean think time between a reply and the next turn",
        "sigma": "router noise",
        "reply_tokens": "decoded tokens per reply (cap)",
        "seeds": "simulation seeds pooled",
        "taus": "router thresholds swept",
        "slo_s": "the p90 TTFT target of the rate sweep",
        "thresholds": "the gate's quality thresholds compared (comma list)",
        "rates": "arrival rates swept (comma list)",
    },
)
# thresholds: the gate's default (protective) and one that admits relays losing some facts (for comparison)
MODES = ("native", "full", "relay")


@dataclass
class TurnFacts:
    prompt_tokens: int  # transcript tokens through this turn's user message (this model's tokens)
    through_reply: int  # ... through the reference reply
    reply_tokens: int
    score: float  # mean log-likelihood per reply token


def transcript_parts(conv: Conversation, max_turns: int, turn_chars: int) -> list[tuple[str, str]]:
    """(user, assistant) pairs from the start, contents cut to `turn_chars` (the router's turns)."""
    pairs, turns = [], list(conv.turns)
    while len(turns) >= 2 and len(pairs) < max_turns:
        u, a = turns[0], turns[1]
        turns = turns[2:]
        if u.role != "user" or a.role != "assistant":
            break
        pairs.append((u.text[:turn_chars], a.text[:turn_chars]))
    return pairs


def text_of(pairs: list[tuple[str, str]]) -> tuple[str, list[tuple[int, int, int]]]:
    """The transcript (the server's relayed form) and per turn (user end, reply start, reply end) chars."""
    text, spans = "", []
    for u, a in pairs:
        text += f"user: {u}\n\nassistant: "
        start = len(text)
        text += a
        spans.append((start - len("assistant: "), start, len(text)))
        text += "\n\n"
    return text, spans


@torch.inference_mode()
def score_conversation(m: LoadedModel, text: str, spans: list[tuple[int, int, int]]) -> list[TurnFacts]:
    ids, offs = tokenize_context(m, text)
    hidden = runner.forward(m, ids, logits="none").hidden  # the head only where a reply token is predicted
    ends, starts = offs[:, 1], offs[:, 0]
    out = []
    for user_end, a, b in spans:
        inside = (starts >= a) & (ends <= b) & (ends > starts)
        inside[0] = False
        pos = inside.nonzero().view(-1)
        score = 0.0
        if pos.numel():
            lp = torch.log_softmax(runner.head(m, hidden[:, pos - 1], "all").float(), -1)
            score = float(lp.gather(1, ids[pos][:, None]).mean())
        out.append(TurnFacts(int((ends <= user_end).sum()), int((ends <= b).sum()), int(pos.numel()), score))
    return out


def scored(m: LoadedModel, convs: list[Conversation], opts: dict) -> dict[str, list[TurnFacts]]:
    """Per conversation id, the model's facts per turn (cached per model version and conversation)."""
    root = paths.work_dir("router", "scores", f"{m.name}-{m.spec.weights_hash[:12]}")
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for c in tqdm(convs, desc=f"scores {m.name}", unit="conv"):
        pairs = transcript_parts(c, int(opts["max_turns"]), int(opts["turn_chars"]))
        path = root / f"{c.id}-{opts['max_turns']}-{opts['turn_chars']}.json"
        if path.exists():
            facts = [TurnFacts(**d) for d in json.loads(path.read_text())]
        else:
            facts = score_conversation(m, *text_of(pairs))
            path.write_text(json.dumps([f.__dict__ for f in facts]))
        out[c.id] = facts
    return out


def pick_conversations(tokenizers, opts: dict) -> list[Conversation]:
    """Held-out conversations with >= 2 exchanges whose transcript fits `max_tokens` for every model."""
    want, out = int(opts["conversations"]), []
    for c in sharegpt_conversations(limit=40 * want, split="heldout"):
        pairs = transcript_parts(c, int(opts["max_turns"]), int(opts["turn_chars"]))
        while len(pairs) >= 2 and max(len(t(text_of(pairs)[0])["input_ids"]) for t in tokenizers) > int(
            opts["max_tokens"]
        ):
            pairs = pairs[:-1]
        if len(pairs) >= 2:
            out.append(Conversation(c.id, tuple(t for p in pairs for t in _turns(p))))
        if len(out) == want:
            return out
    raise UsageError(
        f"found only {len(out)} held-out conversations of >= 2 exchanges within {opts['max_tokens']} tokens"
    )


def _turns(pair: tuple[str, str]):
    from ctxrelay.data.datasets import Turn

    return Turn("user", pair[0]), Turn("assistant", pair[1])


def decode_seconds(m: LoadedModel, context: int = 1024, n: int = 16, repeats: int = 3) -> float:
    """Median seconds per greedy decode step after a `context`-token prompt (measured here)."""
    ids = torch.randint(100, min(m.spec.vocab_size, 20000), (context,))
    pre = runner.forward(m, ids)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        runner.decode(m, pre.cache.clone(), pre.logits[-1], t0, n, stop_at_eos=False)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times[1:])


# ---- the simulation ---------------------------------------------------------------------------------


@dataclass
class Costs:
    native: dict  # model name -> CostModel of a native prefill of n tokens
    decode_s: dict[str, float]  # model name -> seconds per decoded token
    relay: dict  # (sender, receiver) -> function(context tokens) -> (predicted relay s, refused share) or None

    def incremental(self, model: str, cached: int, new: int) -> float:
        """Prefill of `new` tokens over `cached` ones of the model's own K/V (the quadratic fit's
        difference, plus the fixed cost once)."""
        c = self.native[model]
        fixed = sum(a for a, _, _ in c.coeffs.values())
        return c.total(cached + new) - c.total(cached) + fixed if cached else c.total(new)


def routes(facts: dict, large: str, small: str, tau: float, sigma: float, seed: int) -> dict[str, list[str]]:
    rng = random.Random(seed)
    out = {}
    for cid in sorted(facts[large]):
        margins = [a.score - b.score for a, b in zip(facts[large][cid], facts[small][cid], strict=True)]
        out[cid] = [large if m + rng.gauss(0.0, sigma) > tau else small for m in margins]
    return out


def share_after_large(route: dict[str, list[str]], large: str, small: str) -> float:
    """p: of the small model's turns after a first turn, the share that follow a large-model turn."""
    pairs = [(r[i - 1], r[i]) for r in route.values() for i in range(1, len(r)) if r[i] == small]
    return sum(1 for a, _ in pairs if a == large) / len(pairs) if pairs else 0.0


def simulate(facts: dict, route: dict, costs: Costs, mode: str, rate: float, think_s: float, reply_cap: int,
             seed: int) -> list[dict]:  # fmt: skip
    """Per turn: model, TTFT, prefill seconds, how it was served. Arrivals and think times depend on
    `seed` only, so modes and taus compare on the same arrivals."""
    rng = random.Random(seed + 10_000)
    refusals = random.Random(seed + 20_000)  # its own stream: the arrivals stay the same in every mode
    events, t = [], 0.0
    for cid in sorted(route):
        t += rng.expovariate(rate)
        heapq.heappush(events, (t, cid, 0))
    thinks = {cid: [rng.expovariate(1.0 / think_s) for _ in route[cid]] for cid in route}
    free = dict.fromkeys(costs.native, 0.0)
    cached = {m: {} for m in costs.native}  # model -> conversation -> tokens of its own K/V
    out = []
    while events:
        arrive, cid, j = heapq.heappop(events)
        m = route[cid][j]
        f = facts[m][cid][j]
        have = cached[m].get(cid, 0)
        how, prefill = "native", costs.incremental(m, have, f.prompt_tokens - have)
        if mode == "full":
            how, prefill = "full", costs.native[m].total(f.prompt_tokens)
        elif mode == "relay" and j and route[cid][j - 1] != m:
            ctx = facts[m][cid][j - 1].through_reply  # what the other model's state covers, in m's tokens
            relay = costs.relay.get((route[cid][j - 1], m))
            r = relay(ctx) if relay else None
            if r is not None:
                relay_s, refused = r
                relay_s += costs.incremental(m, ctx, f.prompt_tokens - ctx) - costs.incremental(m, 0, 0)
                if relay_s + refused * prefill < prefill:
                    if refused and refusals.random() < refused:
                        how, prefill = "refused", relay_s + prefill
                    else:
                        how, prefill = "relay", relay_s
        start = max(arrive, free[m])
        decode = min(f.reply_tokens, reply_cap) * costs.decode_s[m]
        free[m] = start + prefill + decode
        cached[m][cid] = f.through_reply
        out.append({"model": m, "ttft_s": start - arrive + prefill, "prefill_s": prefill, "how": how})
        if j + 1 < len(route[cid]):
            heapq.heappush(events, (free[m] + thinks[cid][j], cid, j + 1))
    return out


def pooled(facts: dict, costs: Costs, opts: dict, large: str, small: str, tau: float, rate: float, modes):
    """(mean p, per mode the turns of every seed): each seed's routes once, simulated in each mode."""
    per_mode: dict[str, list[dict]] = {m: [] for m in modes}
    ps = []
    for seed in range(int(opts["seeds"])):
        rt = routes(facts, large, small, tau, float(opts["sigma"]), seed)
        ps.append(share_after_large(rt, large, small))
        for mode in modes:
            per_mode[mode] += simulate(facts, rt, costs, mode, rate, float(opts["think_s"]),
                                       int(opts["reply_tokens"]), seed)  # fmt: skip
    return statistics.mean(ps), per_mode


def sweep(facts: dict, costs: Costs, opts: dict, large: str, small: str) -> tuple[list[dict], dict]:
    """Rows per (tau, mode) at the fixed rate, pooled over seeds; the TTFT samples of the largest p."""
    margins = sorted(
        a.score - b.score for cid in facts[large] for a, b in zip(facts[large][cid], facts[small][cid], strict=True)
    )
    k = int(opts["taus"])
    taus = sorted({margins[min(len(margins) - 1, round(q * (len(margins) - 1) / (k + 1)))] for q in range(1, k + 1)})
    rows, samples = [], {}
    for tau in taus:
        p, per_mode = pooled(facts, costs, opts, large, small, tau, float(opts["rate"]), MODES)
        for mode, turns in per_mode.items():
            ttft = [x["ttft_s"] for x in turns]
            rows.append({"transport": "relay" if mode == "relay" else "native", "method": f"router-{mode}",
                         "tau": tau, "p": p, "turns": len(turns), "rate": float(opts["rate"]),
                         "small_share": sum(x["model"] == small for x in turns) / len(turns),
                         "relayed_turns": sum(x["how"] == "relay" for x in turns),
                         "refused_turns": sum(x["how"] == "refused" for x in turns),
                         "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
                         "ttft_mean_s": statistics.mean(ttft),
                         "small_ttft_p90_s": percentile(_ttfts(turns, small), 90),
                         "large_ttft_p90_s": percentile(_ttfts(turns, large), 90)})  # fmt: skip
        samples[tau] = {m: [x["ttft_s"] for x in t] for m, t in per_mode.items()}
    return rows, samples


def _ttfts(turns: list[dict], model: str) -> list[float]:
    return [x["ttft_s"] for x in turns if x["model"] == model]


def max_rate(facts: dict, costs: Costs, opts: dict, large: str, small: str, tau: float) -> dict[str, float | None]:
    """Per mode, the highest arrival rate of `rates` whose P90 TTFT stays under the SLO (pooled over seeds)."""
    best: dict[str, float | None] = dict.fromkeys(MODES)
    failed: set[str] = set()
    for rate in sorted(float(r) for r in str(opts["rates"]).split(",") if r):
        _, per_mode = pooled(facts, costs, opts, large, small, tau, rate, [m for m in MODES if m not in failed])
        for mode, turns in per_mode.items():
            if percentile([x["ttft_s"] for x in turns], 90) <= float(opts["slo_s"]):
                best[mode] = rate
            else:
                failed.add(mode)
    return best


def measured_costs(pool, large: str, small: str, threshold: float, decode_s: dict[str, float]) -> Costs:
    """Native cost models from the profile, relay predictions from the gate at each length (at this
    quality threshold), decode seconds per token as measured."""
    from ctxrelay.models.capture import capture_state
    from ctxrelay.relay.gate import decide

    native = {}
    for name in (large, small):
        cost = pool.graph.nodes[pool.model(name).spec.weights_hash].native_cost
        if cost is None:
            raise UsageError(f"no native cost profile for {name}: run `ctxrelay profile` (or `ctxrelay demo`) first")
        native[name] = cost
    relay = {}
    for s_name, r_name in ((large, small), (small, large)):
        s, r = pool.model(s_name), pool.model(r_name)
        state = capture_state(s, "A short text whose binding names the sender.", "router")

        def predict(n: int, state=state, r=r, memo: dict = {}) -> float | None:  # noqa: B006 (one memo per edge)
            key = 64 * max(1, round(n / 64))
            if key not in memo:
                d = decide(pool.graph, state, r.spec.weights_hash, key, quality_threshold=threshold)
                chosen = next((c for c in d.candidates if c.point is d.point), None)
                refused = chosen.refused if chosen else 0.0
                memo[key] = (d.predicted_relay_s, refused) if d.transport != "native" else None
            return memo[key]

        relay[(s_name, r_name)] = predict
    return Costs(native, decode_s, relay)


def plot(rows: list[dict], samples: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"native": "tab:blue", "full": "tab:gray", "relay": "tab:orange"}
    for mode in MODES:
        part = sorted((r for r in rows if r["method"] == f"router-{mode}"), key=lambda r: r["p"])
        ax[0].plot([r["p"] for r in part], [r["ttft_p90_s"] for r in part], marker="o", color=colors[mode],
                   label=f"{mode} P90")  # fmt: skip
        ax[0].plot([r["p"] for r in part], [r["ttft_p50_s"] for r in part], ls="--", color=colors[mode],
                   label=f"{mode} P50")  # fmt: skip
    ax[0].set(xlabel="p (share of small-model turns after a large-model turn)", ylabel="TTFT (s)",
              title="TTFT against p")  # fmt: skip
    ax[0].legend(fontsize=7)
    top = max(samples, key=lambda t: next(r["p"] for r in rows if r["tau"] == t))
    for mode, xs in samples[top].items():
        cdf_step(ax[1], xs, color=colors[mode], label=mode)
    ax[1].set(xlabel="TTFT (s)", ylabel="share of turns", xscale="log", title="TTFT CDF at the largest p")
    ax[1].legend()
    return save_figure(fig, path)


def bench(
    model: str = "",
    sender: str = "",
    receiver: str = "",
    lengths: Sequence[int] = (),
    repeats: int = 1,
    out: str = "router",
    options: dict | None = None,
    command: str = "",
) -> Path:
    """Score, measure decode, simulate at each quality threshold -> OUT.json + OUT-q<threshold>.png."""
    from ctxrelay.relay.api import ModelPool

    opts = bench_options("router", options, OPTIONS)
    if model or sender or receiver:
        raise UsageError("bench router takes its models as --set large=... --set small=...")
    large, small = str(opts["large"]), str(opts["small"])
    command = command or f"ctxrelay bench router --set large={large} --set small={small}"
    pool = ModelPool([large, small])
    convs = pick_conversations([pool.model(large).tokenizer, pool.model(small).tokenizer], opts)
    facts = {name: scored(pool.model(name), convs, opts) for name in (large, small)}
    decode_s = {name: decode_seconds(pool.model(name)) for name in (large, small)}
    rows, samples, rates, bar = [], {}, {}, {}
    for q in [float(x) for x in str(opts["thresholds"]).split(",") if x]:
        costs = measured_costs(pool, large, small, q, decode_s)
        part, smp = sweep(facts, costs, opts, large, small)
        for r in part:
            r["quality_threshold"] = q
        rows += part
        top_tau = max(part, key=lambda r: r["p"])["tau"]
        by = {(r["tau"], r["method"]): r for r in part}
        p90s = [(by[(t, "router-native")]["ttft_p90_s"], by[(t, "router-relay")]["ttft_p90_s"]) for t in smp]
        rates[str(q)] = {"tau": top_tau, **max_rate(facts, costs, opts, large, small, top_tau)}
        bar[str(q)] = {"relay_p90_le_native_at_every_p": all(r <= n for n, r in p90s),
                       "relay_p90_cut_at_largest_p": 1 - by[(top_tau, "router-relay")]["ttft_p90_s"]
                       / by[(top_tau, "router-native")]["ttft_p90_s"],
                       "relay_small_model_p90_cut_at_largest_p": 1 - by[(top_tau, "router-relay")]["small_ttft_p90_s"]
                       / by[(top_tau, "router-native")]["small_ttft_p90_s"]}  # fmt: skip
        samples[q] = smp
    extra = {
        "options": opts, "conversations": len(convs), "turns_per_seed": sum(len(f) for f in facts[large].values()),
        "decode_s_per_token": decode_s, "max_rate_under_slo": rates, "bar": bar,
    }  # fmt: skip
    path = write_results(out, rows, command, extra)
    for q, smp in samples.items():
        plot([r for r in rows if r["quality_threshold"] == q], smp, plot_path(path, f"-q{q:g}"))
    return path
