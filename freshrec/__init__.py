"""FreshRec: recommendations served over Kafka from embeddings that learn online.

This package holds what every service shares: settings, the Kafka client profile, the topic
catalogue, the embedded stack and the command line. The services live beside it in
``streams/``, ``inference/`` and ``param_server/``; wire contracts in ``schemas/``.
"""

__version__ = "0.1.0"
