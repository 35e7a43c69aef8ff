"""Tenant isolation as a property: random tenants and texts in every backend and through the pool;
no call reads another tenant's state."""

import logging

from ctxrelay.relay.api import ModelPool
from ctxrelay.relay.graph import Profile
from ctxrelay_bench.reliability import store_checks as rs


def test_no_cross_tenant_read_through_any_call(tiny_by_family, tmp_path):
    logging.getLogger("ctxrelay").setLevel(logging.ERROR)
    llama = tiny_by_family["llama"]
    pool = ModelPool([llama], artifact_dirs=[tmp_path / "none"], profile=Profile())
    c = rs.tenant_isolation(pool, llama.name, tmp_path, cases=120, pool_cases=15)
    assert c.cases == 120
    assert c.details["violations"] == 0 and c.requests_failed == 0 and c.unhandled == 0, c.failures
    assert c.details["reads_refused"] > c.cases  # every case tried other tenants' keys
