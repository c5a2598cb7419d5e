"""The ``kvkit`` subcommands, one module each, imported only when run (see ``kvkit.cli``)."""
