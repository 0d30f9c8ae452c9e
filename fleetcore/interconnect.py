"""KV transfer links between instances: what moving a prefilled request's KV costs.

One model of the link for everyone who needs it: the simulated fleet times transfers with
it, TokenPilot's P/D decision predicts them with it. Pure: numbers in, seconds out.

* Inside a site: the site's `interconnect` (bandwidth GB/s, set-up latency), one link per
  sending instance (its NIC): transfers from one prefill instance queue behind each other.
* Between sites: the fleet's `wan.bandwidth_gb_s`, latency half the round trip the sending
  site gives for the receiving site's region (`rtt_ms`), as FleetMind reads it.

Bytes are the model's KV per token (K and V of every layer, `ModelSpec.kv_bytes_per_token`)
times the tokens that cross: the prompt less what the receiver already holds as a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetcore.fleet_config import FleetConfig
from fleetcore.hardware import ModelSpec


@dataclass(frozen=True, slots=True)
class Link:
    bandwidth_bytes_s: float
    latency_s: float

    def transfer_s(self, nbytes: float) -> float:
        """Seconds from the first byte sent to the last received, on an idle link."""
        return self.latency_s + nbytes / self.bandwidth_bytes_s


def kv_bytes(model: ModelSpec, tokens: int) -> int:
    """KV bytes of `tokens` tokens of `model` (all TP shards together: the whole request moves)."""
    return model.kv_bytes_per_token * max(0, tokens)


def link_between(fleet: FleetConfig, src_site: str, dst_site: str) -> Link:
    """The link a transfer from an instance at `src_site` to one at `dst_site` takes."""
    src = fleet.site(src_site)
    if src_site == dst_site:
        ic = src.interconnect
        return Link(ic.bandwidth_gb_s * 1e9, ic.latency_ms / 1000.0)
    dst = fleet.site(dst_site)
    rtt = src.rtt_ms.get(dst.region, dst.rtt_ms.get(src.region))
    if rtt is None:
        raise ValueError(f"no rtt_ms between sites {src_site!r} and {dst_site!r} (give {src_site!r} "
                         f"rtt_ms[{dst.region!r}])")
    return Link(fleet.wan.bandwidth_gb_s * 1e9, rtt / 2000.0)


@dataclass(slots=True)
class LinkQueue:
    """One sender's link as a FIFO: a transfer starts when the previous one has left.

    `busy_until` is when the link frees up; `reserve` books a transfer and returns its
    (start, end). Clock-free: callers pass `now`.
    """

    link: Link
    busy_until: float = 0.0

    def wait_s(self, now: float) -> float:
        return max(0.0, self.busy_until - now)

    def reserve(self, now: float, nbytes: float) -> tuple[float, float]:
        start = max(now, self.busy_until)
        end = start + self.link.transfer_s(nbytes)
        # The set-up latency does not hold the wire: the next transfer may start after the bytes.
        self.busy_until = start + nbytes / self.link.bandwidth_bytes_s
        return start, end
