"""The policy server's metrics, through Ray's metrics API (`ray.util.metrics`): exported with
Serve's own on each node's Prometheus endpoint (the `metrics_export_port` of `ray start`),
tagged by deployment and route.

    rayrep_serve_requests_total{deployment, route, status}   requests answered, by HTTP status
    rayrep_serve_request_seconds{deployment, route}          latency to the last byte
    rayrep_serve_first_token_seconds{deployment, route}      time to the first answer token
    rayrep_serve_prompt_tokens_total{deployment, route}      tokens in
    rayrep_serve_completion_tokens_total{deployment, route}  tokens out

Routes outside the API count as "other", so that a client cannot grow the label set.
"""

from __future__ import annotations

ROUTES = ("/health", "/v1/models", "/v1/completions", "/v1/chat/completions")
SECONDS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300]
"""Histogram boundaries: from a health check to a long answer at paper scale."""


def route_of(path: str) -> str:
    return path if path in ROUTES else "other"


class ServerMetrics:
    """One replica's metrics (made in the replica: Ray reports them from the process that
    records them)."""

    def __init__(self, deployment: str):
        from ray.util.metrics import Counter, Histogram

        by_route = ("deployment", "route")
        self.deployment = deployment
        self.requests = Counter("rayrep_serve_requests", description="requests answered, by route and HTTP status",
                                tag_keys=(*by_route, "status"))
        self.latency = Histogram("rayrep_serve_request_seconds", description="seconds from request to last byte",
                                 boundaries=SECONDS, tag_keys=by_route)
        self.first_token = Histogram("rayrep_serve_first_token_seconds",
                                     description="seconds from request to the first answer token",
                                     boundaries=SECONDS, tag_keys=by_route)
        self.prompt_tokens = Counter("rayrep_serve_prompt_tokens", description="prompt tokens", tag_keys=by_route)
        self.completion_tokens = Counter("rayrep_serve_completion_tokens", description="answer tokens",
                                         tag_keys=by_route)

    def _tags(self, path: str) -> dict[str, str]:
        return {"deployment": self.deployment, "route": route_of(path)}

    def answered(self, path: str, status: int, seconds: float) -> None:
        self.requests.inc(1, {**self._tags(path), "status": str(status)})
        self.latency.observe(seconds, self._tags(path))

    def generated(self, path: str, prompt_tokens: int, completion_tokens: int, first_token_seconds: float | None) -> None:
        self.prompt_tokens.inc(prompt_tokens, self._tags(path))
        if completion_tokens:
            self.completion_tokens.inc(completion_tokens, self._tags(path))
        if first_token_seconds is not None:
            self.first_token.observe(first_token_seconds, self._tags(path))


_held: ServerMetrics | None = None


def hold(metrics: ServerMetrics | None) -> None:
    """This process's replica records into `metrics` (one replica per process)."""
    global _held
    _held = metrics


def held() -> ServerMetrics | None:
    return _held
