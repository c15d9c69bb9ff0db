"""Request, batch and rejection counters and latency histograms, rendered in the Prometheus text format."""

from __future__ import annotations

from collections import defaultdict


class Metrics:
    BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, float("inf"))

    def __init__(self):
        self.counters: dict[tuple[str, tuple], float] = defaultdict(float)
        self.latency: dict[str, list[int]] = defaultdict(lambda: [0] * len(self.BUCKETS))
        self.latency_sum: dict[str, float] = defaultdict(float)

    def inc(self, name: str, labels: dict[str, str] | None = None, value: float = 1.0) -> None:
        self.counters[(name, tuple(sorted((labels or {}).items())))] += value

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.inc("emotune_requests_total", {"endpoint": endpoint, "status": str(status)})
        self.latency_sum[endpoint] += seconds
        for i, bound in enumerate(self.BUCKETS):
            if seconds <= bound:
                self.latency[endpoint][i] += 1

    def observe_batch(self, texts: int) -> None:
        self.inc("emotune_batches_total")
        self.inc("emotune_classified_texts_total", value=texts)

    def render(self, gauges: dict[str, float], lanes: dict[str, tuple[float, int]] | None = None) -> str:
        """The text format; `lanes`: the model thread's (seconds, calls) per lane since start."""
        lines = []
        for (name, labels), value in sorted(self.counters.items()):
            lines.append(f"{name}{_labels(dict(labels))} {value:g}")
        for endpoint, counts in sorted(self.latency.items()):
            for bound, count in zip(self.BUCKETS, counts, strict=False):
                le = "+Inf" if bound == float("inf") else f"{bound:g}"
                lines.append(f"emotune_request_seconds_bucket{_labels({'endpoint': endpoint, 'le': le})} {count}")
            lines.append(f"emotune_request_seconds_sum{_labels({'endpoint': endpoint})} {self.latency_sum[endpoint]:.6f}")
            lines.append(f"emotune_request_seconds_count{_labels({'endpoint': endpoint})} {counts[-1]}")
        for lane, (seconds, calls) in (lanes or {}).items():
            lines.append(f"emotune_model_thread_seconds_total{_labels({'lane': lane})} {seconds:.6f}")
            lines.append(f"emotune_model_thread_calls_total{_labels({'lane': lane})} {calls}")
        lines += [f"{name} {value:g}" for name, value in gauges.items()]
        header = ["# TYPE emotune_requests_total counter", "# TYPE emotune_request_seconds histogram",
                  "# TYPE emotune_batches_total counter", "# TYPE emotune_classified_texts_total counter",
                  "# TYPE emotune_rejected_total counter", "# TYPE emotune_model_thread_seconds_total counter",
                  "# TYPE emotune_model_thread_calls_total counter",
                  *(f"# TYPE {name} gauge" for name in gauges)]
        return "\n".join(header + lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
