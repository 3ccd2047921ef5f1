"""Prometheus metrics of the API server (served at /metrics).

Scheduler-side numbers (running/waiting requests, KV usage, cache hit rate, throughput, token
counters) come from the scheduler's SchedulerStats; latencies (time to first token, inter-token latency,
end-to-end) are measured here, where the client sees them.

Routers parse other engines' names, so the load gauges are also published under those
(`RouterMetrics`): vLLM's (the Kubernetes inference gateway's endpoint picker, SMG, Dynamo) and
SGLang's (SMG), each with a `model_name` label as those engines set it.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from minisgl.message import SchedulerStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # no `*_created` series: they only add noise to a scrape


class RouterMetrics:
    """The load gauges under the names routers read (same values as ours, one scrape)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r, label = registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=r)

        # vLLM's names (v1 engine); kv usage is the share of pages not free, in [0, 1]
        self.running = gauge("vllm:num_requests_running", "Requests being prefilled or decoded").labels(model_name)
        self.waiting = gauge("vllm:num_requests_waiting", "Requests queued in the scheduler").labels(model_name)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1").labels(model_name)
        self.gpu_kv_usage = gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 0..1 (vLLM's older name)").labels(model_name)
        # vLLM v1 publishes prefix caching as two token counters (hit rate = hits / queries)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", label, registry=r).labels(
            model_name
        )
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", label, registry=r).labels(
            model_name
        )
        # SGLang's names
        self.queue = gauge("sglang:num_queue_reqs", "Requests queued in the scheduler").labels(model_name)
        self.sglang_running = gauge("sglang:num_running_reqs", "Requests being prefilled or decoded").labels(model_name)
        self.token_usage = gauge("sglang:token_usage", "KV-cache usage, 0..1").labels(model_name)
        self.sglang_hit_rate = gauge("sglang:cache_hit_rate", "Prefix-cache hit rate over all prompt tokens").labels(model_name)

    def update(self, s: SchedulerStats, last: SchedulerStats | None) -> None:
        for g in (self.running, self.sglang_running):
            g.set(s.num_running)
        for g in (self.waiting, self.queue):
            g.set(s.num_waiting)
        for g in (self.kv_usage, self.gpu_kv_usage, self.token_usage):
            g.set(s.kv_usage)
        self.sglang_hit_rate.set(s.cache_hit_rate)
        self.prefix_queries.inc(max(0, s.prompt_tokens - (last.prompt_tokens if last else 0)))
        self.prefix_hits.inc(max(0, s.cache_hit_tokens - (last.cache_hit_tokens if last else 0)))


class ServerMetrics:
    def __init__(self, model_name: str = "") -> None:
        r = self.registry = CollectorRegistry()
        self.num_running = Gauge("minisgl_num_running_requests", "Requests being prefilled or decoded", registry=r)
        self.num_waiting = Gauge("minisgl_num_waiting_requests", "Requests queued in the scheduler", registry=r)
        self.num_active = Gauge(
            "minisgl_scheduler_active_requests", "Requests holding a page-table row (running or being released)", registry=r
        )
        self.kv_usage = Gauge("minisgl_kv_cache_usage", "Share of KV pages in use by requests (0..1)", registry=r)
        self.kv_total = Gauge("minisgl_kv_pages_total", "KV pages in the pool", registry=r)
        self.kv_free = Gauge("minisgl_kv_pages_free", "KV pages free or evictable", registry=r)
        self.window_total = Gauge("minisgl_window_pages_total", "Window KV pages of the sliding layers (0: no window pool)", registry=r)
        self.window_free = Gauge(
            "minisgl_window_pages_free", "Window KV pages free or held only where no admitted request reads them", registry=r
        )
        self.cached_pages = Gauge("minisgl_prefix_cache_pages", "KV pages held by the prefix cache", registry=r)
        self.cache_hit_rate = Gauge("minisgl_cache_hit_rate", "Prompt tokens served from the prefix cache / all prompt tokens", registry=r)
        self.throughput = Gauge("minisgl_gen_throughput_tokens_per_second", "Output tokens per second (recent)", registry=r)
        self.prompt_tokens = Counter("minisgl_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("minisgl_generation_tokens", "Tokens generated", registry=r)
        self.retractions = Counter(
            "minisgl_retracted_requests", "Requests whose KV pages were taken back when the pool ran out (resumed by recompute)", registry=r
        )
        self.peak_running = Gauge("minisgl_peak_running_requests", "Most requests running at once since start", registry=r)
        self.num_retracted = Gauge("minisgl_num_retracted_requests", "Retracted requests waiting to resume", registry=r)
        self.new_token_ratio = Gauge(
            "minisgl_new_token_ratio", "Admission estimate: share of max_tokens a running request still generates", registry=r
        )
        self.aborted = Counter("minisgl_aborted_requests", "Requests aborted in the scheduler", registry=r)
        self.spec_proposed = Counter("minisgl_spec_proposed_tokens", "Speculative draft tokens verified", registry=r)
        self.spec_accepted = Counter("minisgl_spec_accepted_tokens", "Speculative draft tokens accepted", registry=r)
        self.spec_acceptance = Gauge("minisgl_spec_acceptance_rate", "Accepted / proposed draft tokens since start", registry=r)
        self.spec_accept_length = Gauge(
            "minisgl_spec_mean_accepted_length", "Tokens per speculating row and step since start (accepted drafts + 1)", registry=r
        )
        self.requests = Counter("minisgl_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.in_flight = Gauge("minisgl_http_requests_in_flight", "Generation requests the API server is waiting on", registry=r)
        self.ttft = Histogram("minisgl_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("minisgl_inter_token_latency_seconds", "Time between output tokens", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("minisgl_e2e_request_latency_seconds", "Request latency", buckets=_E2E_BUCKETS, registry=r)
        self.router = RouterMetrics(r, model_name)
        self._last: SchedulerStats | None = None

    def update_stats(self, s: SchedulerStats) -> None:
        self.num_running.set(s.num_running)
        self.num_waiting.set(s.num_waiting)
        self.num_active.set(s.num_active)
        self.kv_usage.set(s.kv_usage)
        self.kv_total.set(s.total_pages)
        self.kv_free.set(s.free_pages)
        self.window_total.set(s.window_total_pages)
        self.window_free.set(s.window_free_pages)
        self.cached_pages.set(s.cached_pages)
        self.cache_hit_rate.set(s.cache_hit_rate)
        self.throughput.set(s.gen_throughput)
        self.peak_running.set(s.peak_running)
        self.num_retracted.set(s.num_retracted)
        self.new_token_ratio.set(s.new_token_ratio)
        last = self._last
        self.router.update(s, last)
        self.prompt_tokens.inc(max(0, s.prompt_tokens - (last.prompt_tokens if last else 0)))
        self.generation_tokens.inc(max(0, s.generated_tokens - (last.generated_tokens if last else 0)))
        self.aborted.inc(max(0, s.aborted_requests - (last.aborted_requests if last else 0)))
        self.retractions.inc(max(0, s.retractions - (last.retractions if last else 0)))
        self.spec_proposed.inc(max(0, s.spec_proposed_tokens - (last.spec_proposed_tokens if last else 0)))
        self.spec_accepted.inc(max(0, s.spec_accepted_tokens - (last.spec_accepted_tokens if last else 0)))
        self.spec_acceptance.set(s.spec_acceptance_rate)
        self.spec_accept_length.set(s.spec_mean_accepted_length)
        self._last = s

    def render(self) -> bytes:
        return generate_latest(self.registry)
