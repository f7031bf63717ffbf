"""Webhook-style routes: requests a provider calls, verified on raw bytes first.

    esp.py              POST /hooks/esp/{tenant}/{source}: delivery events of sending
                        providers (the served table, the route, its per-source limits)
    esp_config.py       `[[delivery_sources]]` tables → the served table; SNS confirmation
    gmail_config.py     the tenants' `[gmail]` tables → the served table of
                        POST /push/gmail/{tenant} (adapters/gmail/push_route.py)
    outlook_config.py   the tenants' `[outlook]` tables → the served table of
                        POST /push/outlook/{tenant}[/lifecycle]
                        (adapters/outlook/notifications.py)

A door's push routes live in its own folder and import nothing of the daemon:
what they share with the ESP hooks (the route contract, error answers, the token
buckets behind the 429s) is adapters/webhook_routes.py and
adapters/webhook_budgets.py, and what they need at run time (the pool, the
metrics) comes in a `RouteContext` given by daemon/supervisor.py.

Each route set gives the listener its routes, each request's body limit and the
checks that run before a byte of the body is read; `Webhooks` joins the sets into
the one `WebhookRoutes` the listener takes (`HttpState.webhooks`,
daemon/http/state.py). A handler verifies, records, rings a doorbell and
answers: no sync and no event processing runs inside a request.
"""

from __future__ import annotations

from aiohttp import web

from inboxd.adapters.webhook_routes import WebhookRoutes

__all__ = ["Webhooks"]


class Webhooks:
    """Several route sets served as one; each request is asked of the set that owns it."""

    def __init__(self, *route_sets: WebhookRoutes) -> None:
        self._sets = route_sets
        self._owners: dict[str, WebhookRoutes] = {}
        self._routes: list[web.RouteDef] = []
        for route_set in route_sets:
            for route in route_set.routes():
                self._owners[route.path] = route_set
                self._routes.append(route)

    def routes(self) -> list[web.RouteDef]:
        return list(self._routes)

    def body_limit(self, request: web.Request) -> int | None:
        owner = self._owner(request)
        return owner.body_limit(request) if owner is not None else None

    def check_before_body(self, request: web.Request) -> None:
        owner = self._owner(request)
        if owner is not None:
            owner.check_before_body(request)

    def _owner(self, request: web.Request) -> WebhookRoutes | None:
        resource = request.match_info.route.resource
        return self._owners.get(resource.canonical) if resource is not None else None
