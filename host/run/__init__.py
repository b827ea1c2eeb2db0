"""The library behind the public API (``poet_edge``) and the `poet` command: solve, train, verify.

Both call these same functions, so the Python API and the CLI cannot drift apart. The package itself imports
nothing: ``host.run.values`` and ``host.run.errors``, which the CLI's parsers need, load without torch, so
`poet --help` and a bad flag answer at once. The public names are ``poet_edge``'s.
"""
