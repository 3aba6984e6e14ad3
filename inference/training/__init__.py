"""``freshrec train``: the starting rows and the ranking models from the synthetic world's logs or
an interaction log, fitted offline."""
