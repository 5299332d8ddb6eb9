"""The ``Stats`` reply is the cache's ``StatsReport`` converted once, at the servicer: store notes
become the message's strings there (and only there), and the engine's report rides in the same
record. No server: the conversion is a function of the record."""

from __future__ import annotations

from gateway.core.admin_reports import EngineReport, StatsReport, StoreReport, TierReport
from gateway.service.admin_servicer import stats_response

TIER = TierReport(name="device", num_blocks=2, used_bytes=512, budget_bytes=1024, hits=1,
                  inserts=2, refused=0, promotions=0, demotions=0, load_failures=0,
                  recomputed_instead=0, evictions={"capacity": 1})
ENGINE = EngineReport(route="batched", route_reason="default", steps=3, prefill_tokens=32,
                      decode_tokens=4, max_requests_in_step=2, dedup_waits=0, dtype="float32",
                      device="cpu", tail_hits=1, tail_tokens=16, tail_bytes=2048)


def report(*, engine: EngineReport | None = None) -> StatsReport:
    store = StoreReport(name="disk", num_blocks=2, puts=2, verification_failures={"mac": 1},
                        notes={"load_bytes_per_s": 1_500_000_000, "ratio": 0.5,
                               "unavailable_reason": "ENOSPC"})
    return StatsReport(num_blocks=2, num_namespaces=1, num_token_mismatches=0,
                       num_remote_hits=0, tiers=(TIER,), stores=(store,), engine=engine)


def test_store_notes_reach_the_reply_as_the_strings_of_their_values() -> None:
    [store] = stats_response(report()).stores
    assert dict(store.notes) == {"load_bytes_per_s": "1500000000", "ratio": "0.5",
                                 "unavailable_reason": "ENOSPC"}
    assert (store.name, store.num_blocks, store.puts, dict(store.verification_failures)) == (
        "disk", 2, 2, {"mac": 1})


def test_the_engines_report_rides_in_the_reply_and_its_absence_leaves_the_field_unset() -> None:
    reply = stats_response(report(engine=ENGINE))
    assert (reply.engine.route, reply.engine.steps, reply.engine.device, reply.engine.dtype,
            reply.engine.tail_bytes) == ("batched", 3, "cpu", "float32", 2048)
    assert not stats_response(report()).HasField("engine")
