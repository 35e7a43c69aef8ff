"""Every deserializer a user's file reaches, fed generated damage: a named error or the intact file,
never a crash or a partly used state (ctxrelay_bench/reliability/fuzz.py; `ctxrelay bench reliability` runs
1000+ each)."""

import pytest

from ctxrelay_bench.reliability import fuzz

CASES = 250
pytestmark = pytest.mark.usefixtures("own_cache")


@pytest.mark.parametrize("name", sorted(fuzz.targets()))
def test_damaged_files_are_refused_by_name_never_crash(name):
    tally = fuzz.run(fuzz.targets()[name], CASES)
    assert tally.cases == CASES
    assert tally.bad == 0, tally.examples
    assert tally.outcomes["refused"] > CASES // 2  # most damage is caught, not absorbed
    expected = {"truncate", "bitflip", "garbage", "splice"}
    expected |= (
        {"huge_header", "huge_offsets", "edit_binding", "foreign_seal", "owner_sealed_malformed"}
        if (fuzz.targets()[name].tensor_file)
        else {"json_edit"}
    )
    assert set(tally.kinds) == expected
