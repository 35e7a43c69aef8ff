"""heterofold limits diagnosis: the oracle variants swap exactly the named parts of the cache."""

import pytest
import torch

from conftest import SAMPLE_TEXT
from ctxrelay.models import runner
from ctxrelay.models.capture import capture_state
from ctxrelay.transports.heterofold import identity_artifact
from ctxrelay.transports.heterofold.calibration import heldout as quality
from ctxrelay_bench.heterofold_limits.bench import VARIANTS, limits, mix, translated_cache


def test_self_transfer_with_identity_maps_leaves_nothing_to_explain(tiny):
    items = [quality.make_item(tiny, tiny, SAMPLE_TEXT, suffix_tokens=24)]
    res = limits(tiny, identity_artifact(tiny), items)
    assert set(res) == set(VARIANTS)
    for v, q in res.items():
        assert q["top1_agreement"] == 1.0, v
        assert q["kl"] < 1e-6, v
        assert q["ppl"]["16"] == pytest.approx(q["native_ppl"]["16"], rel=1e-4), v


def test_variants_take_keys_values_and_layers_from_the_named_side(tiny_by_family):
    m = tiny_by_family["llama"]
    state = capture_state(m, SAMPLE_TEXT[:200], "t")
    trans, ids = translated_cache(m, state, identity_artifact(m))
    native = runner.forward(m, ids, logits="none").cache
    for i in range(len(native.keys)):  # identity maps: the translated cache is the native one
        assert torch.allclose(trans.keys[i], native.keys[i], atol=1e-4)
    fake = type(trans)([k + 1 for k in trans.keys], [v + 1 for v in trans.values])
    n, half = len(native.keys), len(native.keys) // 2
    own = {
        "translated": ([], []),
        "native-K": (range(n), []),
        "native-V": ([], range(n)),
        "native-early": (range(half), range(half)),
        "native-late": (range(half, n), range(half, n)),
    }
    for v, (ks, vs) in own.items():
        c = mix(fake, native, v)
        for i in range(n):
            assert torch.equal(c.keys[i], (native if i in ks else fake).keys[i]), (v, "k", i)
            assert torch.equal(c.values[i], (native if i in vs else fake).values[i]), (v, "v", i)
    with pytest.raises(ValueError, match="unknown variant"):
        mix(fake, native, "native-Q")
