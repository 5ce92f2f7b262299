"""Publish the model the agents use: the proxy's address and the model name it serves.

    python examples/first_agent/publish.py [STORE] [PROXY_URL] [MODEL]

A rollout gets the latest resources set unless it names one. The runner routes the ``ProxyLLM`` to
each attempt (``.../rollout/{rollout_id}/attempt/{attempt_id}/v1``). Waits up to a minute for a
store that is still starting.
"""

import sys

from lightning_grpc.client import SyncStoreClient
from lightning_grpc.errors import LightningError
from lightning_grpc.types import ProxyLLM

DEFAULTS = ["127.0.0.1:4747", "http://127.0.0.1:4748/v1", "tiny"]
given = sys.argv[1:4]
store, proxy, model = given + DEFAULTS[len(given) :]
try:
    with SyncStoreClient(store) as client:
        client.wait_until_reachable(60)
        update = client.add_resources({"llm": ProxyLLM(endpoint=proxy, model=model)})
except LightningError as exc:
    sys.exit(f"error: {exc.reason}: {exc.message}")
print(f"published {update.resources_id}: llm = {model} behind {proxy}")
