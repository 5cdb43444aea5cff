"""The OpenAI-compatible gateway (``batchfleet serve``): HTTP over AsyncClient, no model, no torch.

    from batchfleet.gateway import GatewayConfig
    from batchfleet.gateway.app import create_app
    app = create_app(GatewayConfig(api_keys=("sk-local-1234",)))   # any ASGI server runs it

Only this package's ``app`` needs FastAPI (``batchfleet[serve]``): importing the package or its CLI
module does not, so ``batchfleet --help`` works on a client-only install.
"""

from batchfleet.gateway.config import GatewayConfig

__all__ = ["GatewayConfig"]
