"""The HTTP gateway: E2B's API and envd, dsec's REST API, sandbox ports; its own process
(``python -m sdk.gateway``), built on the client: it reaches sandboxes only through bus subjects."""

from ._app import EXTENSIONS, GATEWAY_KEY, Gateway, GatewayConfig, make_app
from ._keys import create_api_key

__all__ = ["EXTENSIONS", "GATEWAY_KEY", "Gateway", "GatewayConfig", "create_api_key", "make_app"]
