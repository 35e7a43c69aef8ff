"""mapflow on the real zoo models: exactness on qwen2.5-coder-0.5b, and the shipped Qwen-pair artifact."""

import pytest
import torch

from ctxrelay import paths
from ctxrelay.artifact import Artifact
from ctxrelay.models import runner
from ctxrelay.models.tokens import tokenize_context
from ctxrelay.state import Binding, ContextState
from ctxrelay.transports import mapflow
from ctxrelay.transports.mapflow import reuse
from ctxrelay.transports.mapflow.mixing import identity_w
from ctxrelay.transports.mapflow.sparse import maps_from_tensors

pytestmark = pytest.mark.real

SENDER, RECEIVER = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
TEXT = (
    "The most important thing for a startup is to make something people want. Most startups fail because "
    "they make something nobody wants, and the founders only find out after they have spent all their money. "
    "So the best way to begin is to talk to users early, watch what they actually do, and change the product "
    "until they would be upset if it went away. Growth follows from that, not from marketing alone. "
)


@pytest.fixture(scope="module")
def receiver():
    from ctxrelay import zoo

    return zoo.load(RECEIVER)


def _capture(m, ids, top_p, dtype, block=64):
    cap = mapflow.make_map_capture(m, top_p=top_p, block=block, dtype=dtype)
    runner.forward(m, ids, capture=runner.Capture(on_probs=cap.on_probs, prob_chunk=block), logits="none")
    return cap.result()


def test_real_model_reusing_own_uncompressed_maps_reproduces_native(receiver):
    ids = tokenize_context(receiver, TEXT * 2)[0][:160]
    native = runner.forward(receiver, ids, logits="all").logits
    tensors, meta = _capture(receiver, ids, 1.0, torch.float32)
    s = receiver.spec
    for mode in ("replace", "guided"):
        cfg = reuse.ReuseConfig(
            [mode] * s.num_layers,
            list(range(s.num_layers)),
            {j: identity_w(s.num_heads) for j in range(s.num_layers)},
            top_p=1.0,
            guided_p=1.0,
            unit="head",
        )
        with torch.inference_mode():
            _, h = reuse.context_pass(receiver, ids, maps_from_tensors(tensors, meta), cfg)
            logits = runner.head(receiver, h, "all")
        assert (logits - native).abs().max() < 1e-3, mode  # 24 real layers, sums reordered in the BSR product
        assert (logits.argmax(-1) == native.argmax(-1)).all()


def test_shipped_artifact_relays_the_qwen_pair(receiver):
    from ctxrelay import zoo

    path = paths.PACKAGED_ARTIFACTS / paths.artifact_name("mapflow", SENDER, RECEIVER)
    art = Artifact.load(path, transport=mapflow.TRANSPORT, version=mapflow.ARTIFACT_VERSION)
    art.check(None, receiver)
    assert art.command.startswith("ctxrelay calibrate --transport mapflow")
    q = art.quality
    assert 0.0 < q["top1_agreement"] <= 1.0 and q["kl"] >= 0.0 and q["heldout_contexts"] >= 4
    sender = zoo.load(SENDER)
    art.check(sender, receiver)
    ids, offsets = tokenize_context(sender, TEXT * 3)
    ctx, cont = ids[:-32], ids[-32:]
    tensors, meta = _capture(sender, ctx, float(art.params["top_p"]), torch.float16)
    text = sender.tokenizer.decode(ctx)
    st = ContextState(text=text, tokens=ctx, offsets=offsets[:-32], binding=Binding.of(sender, "t"))
    st.set_part(mapflow.PART, tensors, meta)
    out = mapflow.relay_prefill(receiver, st, art, cont[:-1])
    assert abs(out.components_s - sum(out.timings.values())) < 1e-9 and out.components_s > 0
    native = runner.forward(receiver, ids[:-1], logits="last").logits
    relayed = out.logits
    # the relayed receiver predicts the same next token as its native prefill on this easy continuation
    assert int(relayed.argmax()) == int(native.argmax())
