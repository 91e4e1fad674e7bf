"""The proxy's least-loaded choice: fewest in flight, then fewest served, then the first listed; down ones skipped."""
from __future__ import annotations

import pytest

from pagedserve.proxy.instance_pool import DECODE, InstancePool, NoInstanceError


def test_least_loaded_choice():
    pool = InstancePool(DECODE, ["http://a/", "http://b", "http://c"])
    assert [instance.url for instance in pool.instances] == ["http://a", "http://b", "http://c"]
    a, b, c = pool.instances
    assert pool.pick() is a  # all idle and unused: the first
    a.num_requests = 1
    assert pool.pick() is b  # idle ones take turns
    a.num_in_flight, b.num_in_flight, c.num_in_flight = 2, 1, 3
    b.num_requests, c.num_requests = 5, 0
    assert pool.pick() is b  # fewest in flight wins over fewest served
    b.is_up = False
    assert pool.pick() is a  # a down instance gets nothing
    a.is_up = c.is_up = False
    a.last_error = "ConnectError: refused"
    with pytest.raises(NoInstanceError, match="no decode instance is up .*http://a: ConnectError: refused"):
        pool.pick()
    assert not pool.has_live_instance()
