"""Port picking: one process never hands out the same port twice before it is bound."""

from kvobs import _net


def test_ports_picked_one_at_a_time_never_repeat(monkeypatch):
    # Ten candidate ports and ten picks: a pick that forgot the earlier ones would
    # repeat one almost surely (10!/10**10), as two unbound stand-ins did in CI.
    monkeypatch.setattr(_net, "_below_ephemeral", lambda: range(41000, 41010))
    monkeypatch.setattr(_net, "_handed_out", set())
    picked = [_net.free_port() for _ in range(10)]
    assert len(set(picked)) == 10


def test_picks_beyond_the_candidates_fall_back_to_the_kernel(monkeypatch):
    monkeypatch.setattr(_net, "_below_ephemeral", lambda: range(41000, 41002))
    monkeypatch.setattr(_net, "_handed_out", set())
    picked = _net.free_ports(2) + _net.free_ports(3)
    assert len(set(picked)) == 5
    assert sum(41000 <= p < 41002 for p in picked) == 2
