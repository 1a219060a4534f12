"""``GET /metrics`` (admin key): the Prometheus text format.

The counters are ``gateway.sandbox.metrics.Metrics`` (the controllers update them); this
route adds the gauges read at scrape time (sandboxes per state, requests held right now,
warm-pool members ready) and the usage totals per key (``gateway.http.control_routes``).
"""

from __future__ import annotations

from collections import Counter

from aiohttp import web

from gateway.errors import Forbidden
from gateway.http.control_routes import prometheus_lines
from gateway.http.middleware import current_key
from gateway.http.sandbox_routes import SERVICE_KEY

routes = web.RouteTableDef()
METRICS_KEY_NAME = "metrics"


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    if not current_key(request).admin:
        raise Forbidden("metrics need an admin key")
    svc = request.app[SERVICE_KEY]
    states = Counter(r.state.value for r in svc.registry.list())
    text = svc.metrics.render(states, svc.holds.held, svc.pool.ready()) \
        + "\n".join(prometheus_lines(svc)) + "\n"
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})
