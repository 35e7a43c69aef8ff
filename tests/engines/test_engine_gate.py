"""The relay's side of `--engine vllm` that needs no engine: the gate offers only points a KV connector can serve,
its costs are the engine's, `ModelPool.prepare` hands over the relayed cache without decoding, and the
engine's process and request settings (salts, configs) say what they should."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import SAMPLE_TEXT
from ctxrelay import transports
from ctxrelay.artifact import Artifact, model_binding
from ctxrelay.engines.vllm_params import cache_salt, kv_params, transfer_config
from ctxrelay.engines.vllm_server import EngineConfig, VllmServer
from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.spec import wrap
from ctxrelay.relay import ModelPool
from ctxrelay.relay.graph import CostModel, Profile, edge_key
from ctxrelay.serve.engine_profile import LOAD_KEY, _covers, compose
from ctxrelay.transports import RelayOutput, Transport, check_edge

SUFFIX = " Question: what is a startup? Answer:"


class ToyPoints(Transport):
    """The sender's own K/V handed to a copy of the sender, at two points: one any engine can serve, and one
    that (like heterofold's hiding) needs ctxrelay's own attention."""

    name = "toy-points"
    artifact_version = 1

    def operating_points(self, params, quality):
        return [{"label": "hides", "options": {"hide": 1}, "quality": quality},
                {"label": "plain", "options": {}, "quality": quality}]  # fmt: skip

    def engine_servable(self, options):
        return not options.get("hide")

    def relay_prefill(self, receiver, state, artifact, suffix_ids, **options):
        check_edge(self.name, self.artifact_version, receiver, state, artifact)
        cache = runner.cache_from_pre_rope(receiver, state.keys_pre_rope, state.values)
        out = runner.forward(receiver, suffix_ids, cache)
        return RelayOutput(out.cache, out.logits, {"assemble_s": 0.0}, {})


@pytest.fixture
def toy_pool(tiny_by_family, tmp_path):
    t = transports.register(ToyPoints())
    a = tiny_by_family["llama"]
    a2 = wrap(copy.deepcopy(a.hf), a.tokenizer, "tiny-llama-copy", weights_hash="copy-of-" + a.spec.weights_hash)
    art = Artifact(t.name, 1, model_binding(a), model_binding(a2), {"unused": torch.zeros(1)},
                   quality={"top1_agreement": 1.0}, command="test")  # fmt: skip
    art.save(tmp_path / "artifacts" / "toy.safetensors")
    key = edge_key(t.name, a.spec.weights_hash, a2.spec.weights_hash)
    samples = lambda per, comp: [(n, {comp: per * n}) for n in (64, 128, 256)]
    runner_profile = Profile(
        native={a2.spec.weights_hash: CostModel.fit(samples(1e-3, "prefill_s"))},
        edges={f"{key}@hides": CostModel.fit(samples(1e-5, "assemble_s")),
               f"{key}@plain": CostModel.fit(samples(1e-4, "assemble_s"))},
    )  # fmt: skip
    make = lambda engine, profile: ModelPool(
        [a, a2], artifact_dirs=[tmp_path / "artifacts"], profile=profile, engine=engine
    )
    yield a, a2, key, runner_profile, make
    transports.unregister(t.name)


def test_the_engine_gate_offers_only_points_a_connector_can_serve(toy_pool):
    a, a2, key, runner_profile, make = toy_pool
    on_runner, in_engine = make(False, runner_profile), make(True, runner_profile)
    assert [p.label for p in on_runner.graph.calibrated[0].points] == ["hides", "plain"]
    assert [p.label for p in in_engine.graph.calibrated[0].points] == ["plain"]
    assert transports.get("heterofold").engine_servable({"recompute": 0.2, "selection": "mix"})
    assert not transports.get("heterofold").engine_servable({"recompute": 0.2, "hide_translated": 12})
    assert not transports.get("mapflow").engine_servable({})


def test_engine_costs_replace_the_runner_native_and_add_the_engine_load(toy_pool):
    a, a2, key, runner_profile, make = toy_pool
    pool = make(True, runner_profile)
    engine = Profile(
        native={a2.spec.weights_hash: CostModel.fit([(n, {"prefill_s": 2e-4 * n}) for n in (64, 256)])},
        edges={f"{LOAD_KEY}@{a2.spec.weights_hash}": CostModel.fit([(n, {LOAD_KEY: 1e-5 * n}) for n in (64, 256)])},
    )
    composed = compose(runner_profile, engine, pool)
    assert set(composed.edges) == {f"{key}@plain"}  # the hiding point is not the engine's to serve
    cost = composed.edges[f"{key}@plain"].predict(128)
    assert cost["assemble_s"] == pytest.approx(1e-4 * 128, rel=0.05)
    assert cost[LOAD_KEY] == pytest.approx(1.28e-3, rel=0.05)
    assert composed.native[a2.spec.weights_hash].total(128) == pytest.approx(2e-4 * 128, rel=0.05)
    measured = engine.native[a2.spec.weights_hash]
    assert _covers(measured, [64, 256]) and not _covers(measured, [4096])


def test_prepare_hands_over_the_relayed_cache_and_continue_from_decodes_the_same(toy_pool):
    a, a2, key, runner_profile, make = toy_pool
    pool = make(True, runner_profile)
    state = pool.prefill(a.name, SAMPLE_TEXT, tenant="acme")
    p = pool.prepare(state, a2.name, SUFFIX, max_new_tokens=4)
    assert p.relayed and p.decision.point.label == "plain", p.reason
    assert p.context_tokens == p.out.cache.length - len(p.suffix) == state.num_tokens
    res = pool.continue_from(state, a2.name, SUFFIX, max_new_tokens=4)
    ref = pool.native(a2.name, SAMPLE_TEXT, SUFFIX, max_new_tokens=4)
    assert res.transport == "toy-points" and res.tokens == ref.tokens
    assert torch.allclose(p.out.logits[-1], res.first_logits)
    native = pool.prepare(state, a2.name, SUFFIX, transport="native")
    assert not native.relayed and native.reason == "native prefill requested"


def test_salts_keep_tenants_and_relays_apart_and_the_config_names_the_connector():
    assert cache_salt("acme") == cache_salt("acme") != cache_salt("globex")
    assert cache_salt("acme", "relay-1") not in (cache_salt("acme"), cache_salt("acme", "relay-2"))
    cfg = transfer_config("w" * 64)
    assert cfg["kv_connector_module_path"] == "ctxrelay.engines.vllm_connector"
    assert cfg["kv_load_failure_policy"] == "recompute"
    assert cfg["kv_connector_extra_config"]["weights_hash"] == "w" * 64
    want = {"ctxrelay_kv": "/x.safetensors", "tokens": 256, "tenant": "acme"}
    assert kv_params("/x.safetensors", 256, "acme") == want


def test_engine_process_command_and_a_clear_error_without_vllm(tmp_path, monkeypatch):
    s = VllmServer("m", tmp_path, "h" * 64, EngineConfig(), "avx2", tmp_path, window=4096)
    cmd = s.command(tmp_path / "python")
    assert cmd[:3] == ["nice", "-n", "5"]  # the router's short request-path work goes first on shared cores
    cmd = cmd[3:]
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--enable-prefix-caching" in cmd
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--max-model-len") + 1] == "4096"
    assert cmd[cmd.index("--dtype") + 1] == "float32" and "--enforce-eager" in cmd  # fp32 on AVX2: faster there
    compiled = VllmServer("m", tmp_path, "h", EngineConfig(compiled=True), "amx", tmp_path)
    assert compiled.dtype == "bfloat16" and "--enforce-eager" not in compiled.command(tmp_path / "python")
    # AVX512 multiplies bf16 natively only with its bf16 extension (AMD Zen 4, Intel Cooper Lake on)
    assert EngineConfig().resolved_dtype("avx512", bf16=True) == "bfloat16"
    assert EngineConfig().resolved_dtype("avx512", bf16=False) == "float32"
    assert EngineConfig(dtype="float32").resolved_dtype("amx") == "float32"  # a dtype asked for is kept
    monkeypatch.setenv("CTXRELAY_VLLM_PYTHON", str(tmp_path / "missing"))  # named, and not there
    with pytest.raises(UsageError, match="make vllm"):
        s.start()


def test_the_vllm_engine_takes_every_setting_the_native_engine_takes(tiny_by_family):
    """The server builds either engine with one set of keywords (serve/app.py): the vLLM engine (here with no
    engine process started) accepts each of the native engine's and hands it on, conversations included."""
    import inspect

    from ctxrelay.serve.engine import Engine
    from ctxrelay.serve.metrics import Metrics
    from ctxrelay.serve.sessions import SessionStore
    from ctxrelay.serve.vllm_engine import VllmEngine

    native = {n for n, p in inspect.signature(Engine.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY}
    sessions = SessionStore()
    kw = {"max_queue": 3, "request_timeout_s": 7.0, "sessions": sessions}
    assert set(kw) == native  # this test names every keyword the native engine has
    engine = VllmEngine(ModelPool([tiny_by_family["llama"]], store="memory", engine=True), Metrics(), {}, **kw)
    try:
        assert (engine.max_queue, engine.request_timeout_s, engine.kind) == (3, 7.0, "vllm")
    finally:
        engine.close()


@pytest.mark.parametrize(
    "family, reader, engine_s, runner_s, reads",
    [("llama", "auto", 1.0, 2.0, True), ("llama", "auto", 2.0, 1.0, False), ("llama", "engine", 2.0, 1.0, True),
     ("llama", "runner", 1.0, 2.0, False), ("gemma3", "engine", 1.0, 2.0, False)],
)  # fmt: skip
def test_the_state_a_turn_leaves_is_read_by_the_faster_native_that_can_give_it(
    tiny_by_family, tmp_path, family, reader, engine_s, runner_s, reads
):
    """The engine reads a turn's state (capturing its K/V) where --engine-state says so or, "auto", where its
    measured native prefill is no slower than the runner's; never for a family with k-norm (its cached keys
    lost the pre-norm scale the translators read)."""
    from ctxrelay.serve.metrics import Metrics
    from ctxrelay.serve.vllm_engine import VllmEngine

    m = tiny_by_family[family]
    config = EngineConfig(state_reader=reader)
    server = VllmServer(m.spec.name, tmp_path, m.spec.weights_hash, config, "avx2", tmp_path)
    engine = VllmEngine(ModelPool([m], store="memory", engine=True), Metrics(), {m.spec.name: server})
    try:
        h = m.spec.weights_hash
        engine.pool.profile.native[h] = CostModel({"prefill_s": (engine_s, 0.0, 0.0)})
        engine.runner_profile = Profile(native={h: CostModel({"prefill_s": (runner_s, 0.0, 0.0)})})
        assert engine.engine_reads_state(m, SAMPLE_TEXT) is reads
    finally:
        engine.close()


def test_engine_state_option_is_checked():
    with pytest.raises(UsageError, match="--engine-state"):
        EngineConfig.from_options("vllm", "eager", "auto", 2.0, "2048", state_reader="sometimes")
    assert EngineConfig.from_options("vllm", "eager", "auto", 2.0, "2048", "runner").state_reader == "runner"
