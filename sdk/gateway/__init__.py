"""The HTTP gateway: aiohttp routes on top of the dsec client (metrics and the dashboard here)."""

__all__: list[str] = []
