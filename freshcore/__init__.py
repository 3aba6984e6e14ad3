"""The kernel every FreshRec process stands on: settings, the Kafka client profiles and the
topic catalogue, Redis connections and keys, metrics and health endpoints, the service shape
with its start, stop, outage and retry rules, the clock, and the shared pure rules (the hot
score, gradient clipping, co-visitation pairs).

It imports only itself and ``schemas/`` (the contracts): the services (``streams/``,
``inference/``, ``param_server/``), the replay's ``evaluation/`` and the product
(``freshrec/``: the public face, the client, the command line, the simulator) stand on it,
never the other way round (``tests/test_architecture.py``).
"""
