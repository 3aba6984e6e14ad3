"""The application shell: the ``freshrec`` command, the embedded stack, the closed-loop run,
and the dashboards. It may import everything (the services, the kernel, ``tools/``); nothing
outside ``freshrec/app`` and ``tools/`` imports it."""
