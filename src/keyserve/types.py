"""Names shared by every layer, from ``config`` up: imports nothing of keyserve.

``config`` is the ground floor of the import layers (see docs/ARCHITECTURE.md); what it shares
with ``core`` (the request-facing vocabulary) lives here so that neither imports the other.
"""

from __future__ import annotations

from typing import Literal

# The KV eviction policies a request or the engine may name (core/kv_policy.py implements them).
KVPolicyName = Literal["full", "window", "streaming_llm", "h2o", "keyformer"]
# Scoring options of H2O and Keyformer (core/kv_policy.py ``KVBudget``): which queries' attention
# a token's score holds, and whether a layer's kv-heads choose their tokens alone or together.
ScoreWindow = Literal["all", "last", "mean"]
ScorePooling = Literal["kv_head", "layer"]
