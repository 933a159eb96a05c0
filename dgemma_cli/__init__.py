"""dgemma's command line, model store, registry client, Modelfiles and REST server."""

__version__ = "0.1.0"
