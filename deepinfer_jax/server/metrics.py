"""Prometheus metrics with vLLM's names under the `deepinfer:` prefix, one CollectorRegistry per app.

Gauges (num_requests_running / waiting, kv_cache_usage_perc) and the prefix-cache counters are read
from the engine's latest SchedulerStats snapshot at scrape time; the per-request histograms and token
counters are fed by the serving layer as outputs arrive. Every series has a `model_name` label.
`deepinfer:num_requests_in_flight` (ours) counts requests the server is handling, queued ones included.
Ours too: `deepinfer:device_memory_bytes{kind}` (weights, kv_cache, and where the backend reports them the
allocator's limit and in_use), read from the engine at scrape time, and `deepinfer:request_errors_total{status,
type}`, the error replies (streams' in-band error events included). `snapshot()` reads the registry back as
plain numbers for /dashboard/data, so the dashboard and /metrics show the same figures.
The KV cache's host tier (docs/kv-tier.md; all 0 without one): `kv_offload_usage_perc`, `kv_offload_queries` /
`kv_offload_hits` (tokens looked up in / served from it) from the stats, and `kv_offload_bytes{direction}`
(`to_host`, `to_device`) from the memory report.
With --enable-eplb (docs/multi-gpu.md "EPLB"), read from the engine's expert load report at scrape time:
`eplb_expert_load{expert}` (a counter: token copies routed to each logical expert since start, summed over the MoE
layers: E series, not layers x E) and `eplb_balancedness` (the current placement's mean over max EP-rank load on
those counts, averaged over the layers; 1.0 is even).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the app

disable_created_metrics()  # no `_created` series (vLLM does the same)

P = "deepinfer:"
# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        L = ["model_name"]
        self.running = Gauge(P + "num_requests_running", "Sequences running in the engine.", L, registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Sequences waiting to be scheduled.", L, registry=r)
        self.in_flight = Gauge(P + "num_requests_in_flight", "Requests the server is handling.", L, registry=r)
        self.kv_usage = Gauge(P + "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", L,
                              registry=r)
        self.prefix_queries = Counter(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      L, registry=r)
        self.prefix_hits = Counter(P + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", L,
                                   registry=r)
        self.preemptions = Counter(P + "num_preemptions", "Sequences preempted by the scheduler.", L, registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.", L,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between streamed outputs.", L,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency, arrival to finish.", L,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(P + "request_queue_time_seconds", "Time from arrival to first schedule.", L,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", L, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", L, registry=r)
        self.success = Counter(P + "request_success", "Finished sequences by finish reason.",
                               L + ["finished_reason"], registry=r)
        self.device_memory = Gauge(P + "device_memory_bytes", "Device memory: weights, kv_cache, and the "
                                   "allocator's limit and in_use where the backend reports them.", L + ["kind"],
                                   registry=r)
        self.errors = Counter(P + "request_errors", "Error replies by HTTP status and error type.",
                              L + ["status", "type"], registry=r)
        self.offload_usage = Gauge(P + "kv_offload_usage_perc", "Fraction of host-tier KV blocks holding a page.",
                                   L, registry=r)
        self.offload_queries = Counter(P + "kv_offload_queries", "Prompt tokens looked up in the host KV tier.", L,
                                       registry=r)
        self.offload_hits = Counter(P + "kv_offload_hits", "Prompt tokens served from the host KV tier.", L,
                                    registry=r)
        self.offload_bytes = Counter(P + "kv_offload_bytes", "KV bytes copied between the device and the host tier.",
                                     L + ["direction"], registry=r)
        for direction in ("to_host", "to_device"):
            self.offload_bytes.labels(model_name, direction)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(model_name, reason)
        for m in (self.running, self.waiting, self.in_flight, self.kv_usage, self.prefix_queries, self.prefix_hits,
                  self.preemptions, self.ttft, self.itl, self.e2e, self.queue, self.prompt_tokens,
                  self.generation_tokens, self.offload_usage, self.offload_queries, self.offload_hits):
            m.labels(model_name)  # every series exists from the first scrape
        # speculative decoding (vLLM's spec_decode_* counters), fed from the stats' SpecDecodeStats when present
        self.spec_drafts = Counter(P + "spec_decode_num_drafts", "Sequences that verified drafts, by step.", L,
                                   registry=r)
        self.spec_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Draft tokens verified.", L, registry=r)
        self.spec_accepted = Counter(P + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", L, registry=r)
        self.spec_accepted_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position (0: the first draft).",
                                             L + ["position"], registry=r)
        self.expert_load = Counter(P + "eplb_expert_load", "Token copies routed to each logical expert, summed "
                                   "over the MoE layers (--enable-eplb).", L + ["expert"], registry=r)
        self.balancedness = Gauge(P + "eplb_balancedness", "Mean over max EP-rank expert load of the current "
                                  "placement on the observed counts, averaged over MoE layers (1.0: even).", L,
                                  registry=r)
        self._last_expert_load: list[int] = []
        self._last = (0, 0, 0, 0, 0)
        self._last_bytes = {"to_host": 0, "to_device": 0}
        self._last_spec: tuple = (0, 0, 0, ())
        self._children: dict[int, object] = {}

    def _l(self, metric):
        child = self._children.get(id(metric))
        if child is None:
            child = self._children[id(metric)] = metric.labels(self.model_name)
        return child

    # ---- scrape ----------------------------------------------------------------------------------
    def render(self, stats, in_flight: int, memory: dict | None = None, expert_load: dict | None = None) -> bytes:
        self.update(stats, in_flight, memory, expert_load)
        return generate_latest(self.registry)

    def snapshot(self, stats, in_flight: int, memory: dict | None = None,
                 expert_load: dict | None = None) -> dict[str, dict[tuple, float]]:
        """{sample name: {((label, value), ...) without model_name: value}} of the same registry."""
        self.update(stats, in_flight, memory, expert_load)
        out: dict[str, dict[tuple, float]] = {}
        for fam in self.registry.collect():
            for smp in fam.samples:
                labels = tuple(sorted((k, v) for k, v in smp.labels.items() if k != "model_name"))
                out.setdefault(smp.name, {})[labels] = smp.value
        return out

    def update(self, stats, in_flight: int, memory: dict | None = None, expert_load: dict | None = None) -> None:
        if expert_load is not None:  # LLMEngine.expert_load_report (engine/expert_balance.py)
            self._expert_load(expert_load)
        if memory is not None:
            for kind in ("weights", "kv_cache", "limit", "in_use"):
                if memory.get(kind) is not None:
                    self.device_memory.labels(self.model_name, kind).set(memory[kind])
            for direction in ("to_host", "to_device"):
                new = memory.get("kv_offload_" + direction) or 0
                if new > self._last_bytes[direction]:
                    self.offload_bytes.labels(self.model_name, direction).inc(new - self._last_bytes[direction])
                    self._last_bytes[direction] = new
        if stats is not None:
            self._l(self.running).set(stats.num_running)
            self._l(self.waiting).set(stats.num_waiting)
            self._l(self.kv_usage).set(stats.kv_cache_usage)
            self._l(self.offload_usage).set(getattr(stats, "host_tier_usage", 0.0))
            now = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions,
                   getattr(stats, "host_tier_queries", 0), getattr(stats, "host_tier_hits", 0))
            counters = (self.prefix_queries, self.prefix_hits, self.preemptions, self.offload_queries,
                        self.offload_hits)
            for counter, new, old in zip(counters, now, self._last):
                if new > old:
                    self._l(counter).inc(new - old)
            self._last = now
            if getattr(stats, "spec_decode", None) is not None:
                self._spec(stats.spec_decode)
        self._l(self.in_flight).set(in_flight)

    def _expert_load(self, report: dict) -> None:
        now = [int(v) for v in report["per_expert"]]
        old = self._last_expert_load or [0] * len(now)
        for e, (new, prev) in enumerate(zip(now, old)):
            child = self.expert_load.labels(self.model_name, str(e))
            if new > prev:
                child.inc(new - prev)
        self._last_expert_load = now
        self._l(self.balancedness).set(report["balancedness"])

    def _spec(self, sd) -> None:
        now = (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens, tuple(sd.num_accepted_tokens_per_pos))
        for counter, new, old in zip((self.spec_drafts, self.spec_draft_tokens, self.spec_accepted), now,
                                     self._last_spec):
            if new > old:
                self._l(counter).inc(new - old)
        old_pos = self._last_spec[3] or (0,) * len(now[3])
        for pos, (new, old) in enumerate(zip(now[3], old_pos)):
            child = self.spec_accepted_per_pos.labels(self.model_name, str(pos))
            if new > old:
                child.inc(new - old)
        self._last_spec = now

    # ---- per request -----------------------------------------------------------------------------
    def error(self, status: int, type: str) -> None:
        self.errors.labels(self.model_name, str(status), type).inc()

    def first_token(self, seconds: float) -> None:
        self._l(self.ttft).observe(max(seconds, 0.0))

    def inter_token(self, seconds: float) -> None:
        self._l(self.itl).observe(max(seconds, 0.0))

    def finished(self, *, e2e: float, queue: float | None, prompt_tokens: int, generation_tokens: int,
                 reasons: list[str]) -> None:
        self._l(self.e2e).observe(max(e2e, 0.0))
        if queue is not None:
            self._l(self.queue).observe(max(queue, 0.0))
        self._l(self.prompt_tokens).inc(prompt_tokens)
        self._l(self.generation_tokens).inc(generation_tokens)
        for reason in reasons:
            self.success.labels(self.model_name, reason or "abort").inc()
