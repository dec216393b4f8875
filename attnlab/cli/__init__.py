"""The ``attnlab`` command-line tool: one small module per subcommand (see main.py)."""
