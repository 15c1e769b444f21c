"""The ``slotinfer`` command line, one module per command: ``main`` (the parser, ``info``),
``generate``, ``classify``, ``ray_jobs`` (``--ray``), ``serve``, ``bench`` (with ``bench_serve``),
``demo``; ``jobs`` and ``common`` hold what several share.  The entry point is
:func:`slotinfer.cli.main.main`.
"""
