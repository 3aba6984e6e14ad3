"""Prequential evaluation of recommenders on interaction logs: the protocol, the metrics and
the reference baselines (``freshrec replay``)."""
